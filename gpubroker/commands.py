"""Commands: every change of the broker's state runs as one command, with a
:class:`~gpubroker.transitions.Stimulus` (who, and an id shared by all it
causes). After the outermost command the events are published and, when
``Broker.check_state`` asks for it, the state is checked
(:mod:`gpubroker.state_check`). The decorated method's object holds the
broker's :class:`~gpubroker.broker.runner.CommandRunner` as ``runner``.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, TypeVar

F = TypeVar("F", bound=Callable[..., Any])


def command(default_actor: str) -> Callable[[F], F]:
    """Run the decorated method (of the broker or one of its parts) as a command.

    The method gains a keyword argument ``actor`` (who causes the change: a
    user or admin name, ``scheduler``, ``culler``, ``reconcile``); without
    it the actor is ``default_actor``. A command called inside another
    shares the outer one's stimulus.
    """

    def wrap(method: F) -> F:
        @functools.wraps(method)
        def run(self: Any, *args: Any, actor: str | None = None, **kwargs: Any) -> Any:
            with self.runner.command(actor or default_actor):
                return method(self, *args, **kwargs)

        return run  # type: ignore[return-value]

    return wrap
