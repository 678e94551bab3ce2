# The stallfree operator (kopf): SarathiDeployment -> engine fleets. No torch, no GPU.
#   docker build -f docker/operator.Dockerfile -t stallfree/operator:0.1.0 .
FROM python:3.11-slim

ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1

WORKDIR /src
# What docker/install.sh builds the wheel from (tests/test_packaging.py stages exactly these COPY lines).
COPY pyproject.toml setup.py README.md ./
COPY stallfree ./stallfree
COPY engine ./engine
COPY operator ./operator
COPY data/traces ./data/traces
COPY crds ./crds
COPY docker/install.sh docker/smoke.py ./docker/
# The project with the operator extra, then the smoke check (every operator module imports, `stallfree
# operator --help`): the same script the test suite runs.
RUN bash docker/install.sh operator /src && rm -rf /src

RUN useradd --uid 1000 --create-home --shell /usr/sbin/nologin stallfree
USER 1000:1000
WORKDIR /home/stallfree

EXPOSE 8080
ENTRYPOINT ["stallfree", "operator"]
CMD ["--all-namespaces"]
