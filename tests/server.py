"""The real server (uvicorn + worker process) on a free loopback port, for tests."""

from app.server.process import ServerProcess, free_port

__all__ = ["ServerProcess", "free_port"]
