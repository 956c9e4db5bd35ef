"""SpecWhisper on a Ray cluster: the same app as the ingress, engine replicas as a Ray Serve deployment.

Ray is an optional extra (`pip install specwhisper[ray]`); nothing outside this package imports it.
"""

try:
    import ray.serve  # noqa: F401
except ImportError as exc:  # pragma: no cover - the message is what a plain install shows
    raise ImportError("serving on Ray needs Ray Serve: pip install 'specwhisper[ray]'") from exc
