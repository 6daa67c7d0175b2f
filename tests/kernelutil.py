"""Drive a real kernel of a real single-user server: start it through the
server's REST API and run code over its websocket (Jupyter messaging 5.3)."""

from __future__ import annotations

import datetime as dt
import json
import uuid

import requests
import websocket

from .hubutil import RunningHub


def start_kernel(hub: RunningHub, user: str, token: str) -> str:
    """Start a kernel in ``user``'s default server; return its id."""
    r = requests.post(
        f"{hub.url}/user/{user}/api/kernels",
        headers={"Authorization": f"token {token}"},
        json={},
        timeout=60,
    )
    r.raise_for_status()
    return str(r.json()["id"])


def connect(hub: RunningHub, user: str, token: str, kernel_id: str) -> websocket.WebSocket:
    """Open the kernel's channels websocket (as a browser tab would)."""
    url = hub.url.replace("http://", "ws://")
    return websocket.create_connection(
        f"{url}/user/{user}/api/kernels/{kernel_id}/channels?session_id={uuid.uuid4().hex}",
        header=[f"Authorization: token {token}"],
        timeout=30,
    )


def execute(ws: websocket.WebSocket, code: str, wait: bool = True) -> list[str]:
    """Send ``code`` for execution; with ``wait``, return when the kernel is
    idle again, with the errors it raised (``"Name: value"``; empty: none)."""
    errors: list[str] = []
    msg_id = uuid.uuid4().hex
    ws.send(
        json.dumps(
            {
                "header": {
                    "msg_id": msg_id,
                    "username": "test",
                    "session": uuid.uuid4().hex,
                    "msg_type": "execute_request",
                    "version": "5.3",
                    "date": dt.datetime.now(dt.timezone.utc).isoformat(),
                },
                "parent_header": {},
                "metadata": {},
                "content": {
                    "code": code,
                    "silent": False,
                    "store_history": True,
                    "user_expressions": {},
                    "allow_stdin": False,
                    "stop_on_error": True,
                },
                "channel": "shell",
                "buffers": [],
            }
        )
    )
    while wait:
        msg = json.loads(ws.recv())
        if msg.get("parent_header", {}).get("msg_id") != msg_id:
            continue
        content = msg.get("content", {})
        if msg.get("msg_type") == "execute_reply" and content.get("status") == "error":
            errors.append(f"{content.get('ename')}: {content.get('evalue')}")
        if msg.get("msg_type") == "status" and msg["content"].get("execution_state") == "idle":
            return errors
    return errors
