# The stallfree operator (kopf): SarathiDeployment -> engine fleets. No torch, no GPU.
#   docker build -f docker/operator.Dockerfile -t stallfree/operator:0.1.0 .
FROM python:3.11-slim

ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1

WORKDIR /src
COPY pyproject.toml README.md ./
COPY stallfree ./stallfree
COPY engine ./engine
COPY operator ./operator
RUN pip install ".[operator]" && rm -rf /src

RUN useradd --uid 1000 --create-home --shell /usr/sbin/nologin stallfree
USER 1000:1000
WORKDIR /home/stallfree

EXPOSE 8080
ENTRYPOINT ["stallfree", "operator"]
CMD ["--all-namespaces"]
