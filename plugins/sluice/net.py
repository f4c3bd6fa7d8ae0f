"""Loopback ports for the servers sluice and its tests start (Spark Connect, Kafka, Postgres,
Airflow), and waiting for a server's JSON to answer."""

from __future__ import annotations

import json
import socket
import time
import urllib.request
from collections.abc import Callable
from typing import Any, TypeVar

T = TypeVar("T")


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def get_json(url: str, timeout_s: float = 10) -> Any:
    """The JSON a local server answers at ``url`` (a Spark UI's REST API, a master's ``/json/``)."""
    with urllib.request.urlopen(url, timeout=timeout_s) as r:
        return json.load(r)


def poll_json(url: str, pick: Callable[[Any], T], timeout_s: float = 60, every_s: float = 0.5) -> T:
    """``pick`` of the JSON at ``url``, polled until it answers: a Spark driver's UI comes up after
    its server listens, and its REST API lists the application a moment later still. Raises the
    last error after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            return pick(get_json(url))
        except (OSError, ValueError, LookupError, StopIteration):
            if time.monotonic() > deadline:
                raise
            time.sleep(every_s)
