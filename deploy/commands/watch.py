"""`omrl watch ROLE [ARGS...]`: one role (actor, learner, env-server) under a watchdog, for a
container runtime that restarts a container whose process exits but not one whose process
hangs (Docker and compose: a failing health check only marks the container unhealthy).

The role runs as `omrl ROLE ARGS...`, a child in its own process group, with its beat file
(common/liveness.py) at OMRL_BEAT_FILE (default /tmp/omrl-beat). When it stops making progress
for supervisor.hang_s (or has made none supervisor.start_grace_s after its start), the same
bounds and the same check as `omrl run`'s supervisor, watch kills the group and exits 1,
saying why, and the container's restart policy brings it back. Otherwise watch exits with the
role's own code (a learner that finished: 0), and passes SIGTERM and SIGINT on to it (`docker
stop`; the container's stop grace period bounds the wait). The supervisor section is read
from the role's --config and OMRL_SUPERVISOR__* variables, as the role reads its own.
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
import time
from pathlib import Path

DEFAULT_BEAT = "/tmp/omrl-beat"
CHECK_S = 0.5
STOP_WAIT_S = 24 * 3600.0  # a stopped role gets what time it takes: the container's stop grace period bounds it
log = logging.getLogger("omrl.watch")


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("role", choices=("actor", "learner", "env-server"), help="the role to run and watch")
    p.add_argument("args", nargs=argparse.REMAINDER, help="the role's own arguments (--config FILE ...)")


def main(args: argparse.Namespace) -> int:
    from common.cli import add_config_args, config_from_args
    from common.liveness import ENV as BEAT_ENV
    from common.logs import setup_logging
    from deploy.supervisor import Process, describe_exit, stop_all

    setup_logging("omrl", "INFO")
    own = argparse.ArgumentParser(add_help=False)
    add_config_args(own)
    cfg = config_from_args(own.parse_known_args(args.args)[0]).supervisor  # a bad config: exit 2, naming the field
    beat_path = Path(os.environ.get(BEAT_ENV) or DEFAULT_BEAT)
    # Its output goes to this process's stdout (the container's log), and to no file that grows.
    role = Process(args.role, [sys.executable, "-m", "deploy.cli", args.role, *args.args], Path(os.devnull),
                   echo=True, beat_path=beat_path)
    stopping: list[int] = []
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda signum, frame: stopping.append(signum))
    role.start()
    while role.returncode is None:
        if stopping:
            log.info("passing %s on to %s", signal.Signals(stopping[0]).name, args.role)
            stop_all([role], timeout=STOP_WAIT_S)
            break
        hung = role.stalled(cfg.hang_s, cfg.start_grace_s)
        if hung:
            log.error("%s %s: killing it; the container's restart policy starts it again", args.role, hung)
            role.signal(signal.SIGKILL)
            role.proc.wait()
            role.teeing.join(timeout=5)
            return 1
        time.sleep(CHECK_S)
    code = role.returncode
    role.signal(signal.SIGKILL)  # what it left behind in its group (vLLM's engine processes)
    role.teeing.join(timeout=5)  # its last lines, a traceback's, reach the log before watch exits
    if code != 0:
        log.warning("%s %s", args.role, describe_exit(code))
    return code if code >= 0 else 128 - code  # a signal's death as a shell reports it

