"""The dashboard's web server: starlette on uvicorn in a background thread of the monitor.

Routes: ``/`` the page, ``/static/*`` its JS and CSS, ``/api/state`` the swarm as JSON, ``/metrics``
Prometheus text. Needs the ``dashboard`` extra (starlette, uvicorn, prometheus_client).

Requests are answered only when their Host header names the address the dashboard listens on (starlette's
``TrustedHostMiddleware``; the port is not compared): a web page from elsewhere whose name an attacker
re-points at 127.0.0.1 (DNS rebinding) gets 400, not the swarm's state. Listening on every interface
(0.0.0.0 or ::), the dashboard answers whatever name it is reached by.
"""

from __future__ import annotations

import ipaddress
import logging
import socket
import threading
from importlib import resources
from pathlib import Path

from cotrain.dashboard.view import SwarmView

logger = logging.getLogger(__name__)


def static_dir() -> Path:
    return Path(str(resources.files("cotrain.dashboard").joinpath("static")))


def allowed_hosts(host: str) -> list[str]:
    """The names a request's Host header may give for a dashboard listening on ``host`` (["*"]: any)."""
    if host in ("", "0.0.0.0", "::"):
        return ["*"]
    try:
        ip = ipaddress.ip_address(host)
    except ValueError:
        ip = None
    names = [host.lower()]
    if ip is not None and ip.version == 6:
        names = [f"[{host.lower()}]", f"[{ip.compressed}]"]
    if host.lower() == "localhost" or (ip is not None and ip.is_loopback):
        names += ["localhost", "127.0.0.1", "[::1]"]
    return list(dict.fromkeys(names))


def build_app(view: SwarmView, metrics_text, hosts: list[str]):
    """The dashboard's app; ``hosts``: the Host header names it answers (see ``allowed_hosts``)."""
    from starlette.applications import Starlette
    from starlette.middleware import Middleware
    from starlette.middleware.trustedhost import TrustedHostMiddleware
    from starlette.responses import FileResponse, JSONResponse, Response
    from starlette.routing import Mount, Route
    from starlette.staticfiles import StaticFiles

    async def index(request):
        return FileResponse(static_dir() / "index.html", headers={"Cache-Control": "no-cache"})

    async def state(request):
        return JSONResponse(view.to_json(), headers={"Cache-Control": "no-store"})

    async def metrics(request):
        return Response(metrics_text(), media_type="text/plain; version=0.0.4; charset=utf-8")

    return Starlette(
        routes=[
            Route("/", index),
            Route("/api/state", state),
            Route("/metrics", metrics),
            Mount("/static", app=StaticFiles(directory=static_dir()), name="static"),
        ],
        middleware=[Middleware(TrustedHostMiddleware, allowed_hosts=hosts, www_redirect=False)],
    )


class DashboardServer:
    """Binds its socket in the caller's thread (so a busy port is reported at once), serves in a thread."""

    def __init__(self, view: SwarmView, metrics_text, host: str = "127.0.0.1", port: int = 0):
        import uvicorn

        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        self.sock = socket.socket(family, socket.SOCK_STREAM)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            self.sock.bind((host, port))
        except OSError:
            self.sock.close()
            raise
        self.sock.listen(64)
        self.host, self.port = host, self.sock.getsockname()[1]
        config = uvicorn.Config(
            build_app(view, metrics_text, allowed_hosts(host)),
            log_level="warning",
            log_config=None,
            access_log=False,
        )
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self._serve, daemon=True, name="dashboard")
        self.thread.start()

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}/"

    def _serve(self) -> None:
        try:
            self.server.run(sockets=[self.sock])
        except Exception as e:
            logger.warning(f"The dashboard stopped: {e!r}")

    def close(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=5)
        self.sock.close()
