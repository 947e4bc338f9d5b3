"""Signals as exceptions: Ctrl-C, SIGHUP and SIGTERM end streamchat with 130, 129 and 143, after cleaning up.

Each check runs in a child process of its own: signal handlers belong to the whole process.
"""

import signal
import subprocess
import sys
import textwrap

import pytest

from tests.support.processes import in_foreground
from tests.support.waiting import HANG_GUARD_SECONDS

pytestmark = pytest.mark.skipif(sys.platform == "win32", reason="POSIX signals")


def run_python(code: str, ignore: tuple[signal.Signals, ...] = ()) -> subprocess.CompletedProcess[str]:
    def prepare() -> None:
        for signum in ignore:
            signal.signal(signum, signal.SIG_IGN)

    command = [sys.executable, "-c", textwrap.dedent(code)]
    runner = in_foreground(command) if not ignore else command
    return subprocess.run(
        runner, capture_output=True, text=True, timeout=HANG_GUARD_SECONDS, preexec_fn=prepare if ignore else None
    )


def test_ctrl_c_caught_inside_exec_compiled_code_exits_with_the_chosen_code(tmp_path):
    # CPython flags a bare KeyboardInterrupt that ends exec()-compiled code (a dataclass being
    # defined, say) as unhandled even when a caller catches it; run with -m (as the tests and
    # `bootstrap.py chat` run streamchat), the process then dies by SIGINT instead of exiting
    # with its code (-2 here without signals.install()). streamchat's Interrupted is a subclass,
    # which CPython does not flag.
    module = tmp_path / "interrupted_in_exec.py"
    module.write_text(
        textwrap.dedent(
            """
            import os, signal, sys
            from streamchat.interface import signals
            signals.install()
            try:
                exec("os.kill(os.getpid(), signal.SIGINT)", {"os": os, "signal": signal})
            except KeyboardInterrupt as interrupt:
                print(type(interrupt).__name__)
                sys.exit(130)
            """
        )
    )
    command = in_foreground([sys.executable, "-m", module.stem])
    result = subprocess.run(command, capture_output=True, text=True, timeout=HANG_GUARD_SECONDS, cwd=tmp_path)
    assert (result.returncode, result.stdout) == (130, "Interrupted\n"), result.stderr


@pytest.mark.parametrize(("signum", "code"), [(signal.SIGHUP, 129), (signal.SIGTERM, 143)])
def test_a_terminating_signal_during_a_reply_stops_it_and_is_raised_once_the_turn_is_closed(signum, code):
    result = run_python(
        f"""
        import os, sys
        from streamchat.interface import signals
        signals.install()
        stopped = []
        try:
            with signals.termination_deferred(lambda: stopped.append(True)):
                os.kill(os.getpid(), {int(signum)})
                print("the turn closes, stopped:", stopped)
        except signals.Terminated as terminated:
            print("then", terminated.name)
            sys.exit(terminated.exit_code)
        """
    )
    assert result.returncode == code, result.stderr
    assert result.stdout == f"the turn closes, stopped: [True]\nthen {signum.name}\n"


def test_signals_ignored_by_whoever_started_streamchat_stay_ignored():
    result = run_python(
        """
        import signal
        from streamchat.interface import signals
        signals.install()
        print(signal.getsignal(signal.SIGHUP) is signal.SIG_IGN, signal.getsignal(signal.SIGTERM) is signal.SIG_IGN)
        """,
        ignore=(signal.SIGHUP,),
    )
    assert result.stdout == "True False\n", result.stderr
