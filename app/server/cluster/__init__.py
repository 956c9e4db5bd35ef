"""SpecWhisper on a Ray cluster: the same app as the ingress, engine replicas as a Ray Serve deployment.

Ray is an optional extra (`pip install specwhisper[ray]`); nothing outside this package imports it.
"""
