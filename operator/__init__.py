"""Kubernetes operator and budget controller for stallfree (kopf)."""
