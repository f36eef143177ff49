"""A real server on loopback (uvicorn in a thread) for the server tests, and reading its /metrics."""

import asyncio
import re
import socket
import threading
import time
from contextlib import contextmanager

import httpx
import openai
import uvicorn

from specdecode.server import Service, create_app

MODEL = "tiny"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class RunningServer:
    def __init__(self, service: Service, **app_options):
        self.service = service
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        config = uvicorn.Config(create_app(service, **app_options), host="127.0.0.1", port=self.port, log_level="warning")
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, daemon=True)

    def __enter__(self):
        self.thread.start()
        deadline = time.time() + 30
        while not self.server.started:
            assert time.time() < deadline, "server did not start"
            time.sleep(0.05)
        return self

    def __exit__(self, *exc):
        self.server.should_exit = True
        self.thread.join(timeout=30)

    def client(self, **kwargs):
        return openai.OpenAI(base_url=self.url + "/v1", api_key="none", max_retries=0, **kwargs)

    def async_client(self):
        return openai.AsyncOpenAI(base_url=self.url + "/v1", api_key="none", max_retries=0)


class HeldSteps:
    """The scheduler takes no step until `release`: requests sent meanwhile wait together, whatever their timing."""

    def __init__(self, service: Service):
        self.service, self.gate = service, threading.Event()

    async def arrived(self, waiting: int, timeout: float = 30) -> None:
        """Until `waiting` requests wait in the queue."""
        deadline = time.monotonic() + timeout
        while self.service.engine.waiting < waiting:
            assert time.monotonic() < deadline, f"{self.service.engine.waiting} of {waiting} requests arrived"
            await asyncio.sleep(0.01)

    def release(self) -> None:
        self.gate.set()


@contextmanager
def held_steps(service: Service):
    held, step = HeldSteps(service), service.engine.step

    def gated():
        held.gate.wait()
        return step()

    service.engine.step = gated
    try:
        yield held
    finally:
        held.release()
        del service.engine.step  # the engine's own method again


def metric(server, name: str, labels: str = "") -> float:
    text = httpx.get(server.url + "/metrics").text
    pattern = re.escape(name) + (re.escape("{" + labels + "}") if labels else "") + r" ([0-9.e+-]+)"
    found = re.search(r"^" + pattern + "$", text, re.M)
    return float(found.group(1)) if found else 0.0


def post(server, path, body, timeout=60):
    return httpx.post(server.url + path, json=body, timeout=timeout)


def error_of(response, status=400) -> dict:
    assert response.status_code == status, (response.status_code, response.text)
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["code"] == status
    return error
