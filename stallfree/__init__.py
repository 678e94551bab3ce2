"""stallfree: SLO-adaptive, chunked-prefill LLM serving on Kubernetes.

Packages:
    stallfree.engine    the serving engine (scheduler, paged KV cache, model runner, OpenAI server)
    stallfree.operator  the Kubernetes operator and the budget controller
"""

__version__ = "0.1.0"
