"""A pipeline round trip that does the client's own work while the server answers.

`Pipeline.execute` sends the commands and waits for the replies in one call, so the client sits idle while the
server works. `execute_overlapped` sends the commands queued on a pipeline, runs `work`, then reads the replies:
the queue's reader decodes the groups it read one step ahead while its commit is in flight, which takes the
decode off the chain reader → server → reader (they share the machine's cores with the producers).

Contract, as `pipe.execute(raise_on_error=False)`: one reply per queued command, in order, a command's error in
its place as the exception. The pipeline itself is not executed (nor reset). A dropped connection is retried under
the connection's retry policy (`retry.ReconnectWindow` for queue clients) by sending every command again, so they
must be safe to run twice, as for a pipeline; `work` runs once, on the first attempt, after the send. If `work`
raises, the connection (its replies unread) is closed before the error propagates.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import redis


def execute_overlapped(pipe: redis.client.Pipeline, work: Callable[[], None]) -> list[Any]:
    """Send `pipe`'s commands, run `work`, return the replies (errors as exception objects)."""
    commands = list(pipe.command_stack)
    pool = pipe.connection_pool
    connection = pool.get_connection()
    work_left = [work]

    def attempt() -> list[Any]:
        connection.send_packed_command(connection.pack_commands([args for args, _ in commands]))
        while work_left:
            work_left.pop()()
        replies: list[Any] = []
        for args, options in commands:
            try:
                replies.append(pipe.parse_response(connection, args[0], **dict(options)))  # it pops options
            except redis.ResponseError as exc:
                replies.append(exc)
        return replies

    try:
        return connection.retry.call_with_retry(attempt, lambda _error: connection.disconnect())
    except BaseException:
        connection.disconnect()  # replies may be left unread: the next user must not read them
        raise
    finally:
        pool.release(connection)
