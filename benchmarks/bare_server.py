"""A bare Tornado server whose one handler does nothing: the baseline the
broker's API latency is compared with. Usage: ``python bare_server.py PORT``."""

from __future__ import annotations

import asyncio
import sys

from tornado import web


class NothingHandler(web.RequestHandler):
    """Answers every GET, POST and DELETE with an empty JSON object."""

    def get(self) -> None:
        self.finish("{}")

    post = delete = get


async def main(port: int) -> None:
    app = web.Application([(r"/.*", NothingHandler)])
    app.listen(port, "127.0.0.1")
    await asyncio.Event().wait()


if __name__ == "__main__":
    asyncio.run(main(int(sys.argv[1])))
