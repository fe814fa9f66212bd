"""The exit event on every end a client can see, with the status or signal where it can be
known, and an honest line where it cannot (issue 16: a target ended by SIGTERM gave no exit
event at all). Here the test is the program's parent and collects it only at the end, so the
client reads the status from the zombie, as under torchrun; under a shell that collects its
children at once, the status is not visible, and the line says so."""
import os
import signal

import pytest

from gpumon import client

from .conftest import JsonLines, gpumon_popen, wait_for


def _exit_event(p, kill=None):
    a = gpumon_popen("attach", p.pid, "--json")
    js = JsonLines(a)
    js.until(lambda m: m["type"] == "sample", what="a sample")
    if kill is None:
        p.end()
    else:
        os.kill(p.pid, kill)
    ex = js.until(lambda m: m.get("kind") == "exit", what="the exit event")
    js.rest()
    assert a.wait(30) == 0
    return ex


@pytest.mark.parametrize("end,kill,status,sig,how,line", [
    ("exit:3", None, 3, None, "exit", "pid {pid} exited with status 3"),
    ("raise", None, 1, None, "exception",
     "pid {pid} exited with status 1 after an uncaught ValueError: boom"),
    ("run", signal.SIGTERM, None, 15, "signal", "pid {pid} was killed by SIGTERM"),
    ("run", signal.SIGKILL, None, 9, "signal", "pid {pid} was killed by SIGKILL"),
])
def test_exit_event_says_how_the_process_ended(program, end, kill, status, sig, how, line):
    p = program(end, torch=False)
    ex = _exit_event(p, kill)
    assert (ex["status"], ex["signal"], ex["how"]) == (status, sig, how)
    assert ex["line"] == line.format(pid=p.pid)
    assert p.proc.wait(10) == (status if sig is None else -sig)  # what really happened


@pytest.mark.parametrize("kill", [None, signal.SIGKILL])
def test_under_a_shell_that_collects_its_children(program, kill):
    """A shell parent collects its child's status at once: the client may still catch it in
    the moment between the exit and the collection (then it is exact), else it says what it
    does know (whether Python shut down), never a status it did not read."""
    shell = program("raise" if kill is None else "run", torch=False,
                    under=["bash", "-c", '"$@" & echo $! ; wait $!; sleep 30', "bash"])
    pid = int(shell.proc.stdout.readline())
    assert shell.proc.stdout.readline() == "started\n"
    wait_for(lambda: client.scan().get(pid), what="the agent")
    t = client.LocalTarget(shell.pid, nvml_s=None)
    sub = t.subscribe(types=("event",))
    t.start()
    try:
        wait_for(lambda: any(m.serving for m in t.members().values()), what="serving")
        if kill is None:
            shell.end()
        else:
            os.kill(pid, kill)
        while True:
            _, m = sub.get(timeout=30)
            if m.get("kind") == "exit" and m["pid"] == pid:
                break
    finally:
        t.close()
    got = (m["status"], m["signal"], m["how"])
    if kill is None:  # the agent saw the exception on Python's way out: Python exits 1 then
        assert got == (1, None, "exception")
        assert m["line"] in (
            f"pid {pid} ended with an uncaught ValueError: boom (Python exits with status 1)",
            f"pid {pid} exited with status 1 after an uncaught ValueError: boom")
    elif got != (None, 9, "signal"):  # not caught as a zombie
        assert got == (None, None, "unknown")
        assert m["line"] == UNKNOWN.format(pid=pid, ppid=shell.pid)


UNKNOWN = ("pid {pid} ended without Python's shutdown (killed by a signal such as SIGKILL, or "
           "SIGTERM without a handler, or os._exit); its exit status went to its parent (pid "
           "{ppid}), gpumon could not read it")


def test_describe_exit_says_what_is_known_and_no_more():
    from gpumon.client.target import describe_exit
    shutdown = {"how": "shutdown", "exception": None}
    cases = [  # (status, signal, the agent's exit event, served) -> (status, signal, how, line)
        ((None, None, None, True), (None, None, "unknown", UNKNOWN.format(pid=7, ppid=1))),
        ((None, None, shutdown, True), (None, None, "exit", "pid 7 ended through Python's "
                                        "normal shutdown; its exit status went to its parent "
                                        "(pid 1), gpumon could not read it")),
        ((None, None, None, False), (None, None, "unknown", "pid 7 ended; its exit status "
                                     "went to its parent (pid 1), gpumon could not read it")),
        ((0, None, shutdown, True), (0, None, "exit", "pid 7 exited with status 0")),
        ((None, 15, None, True), (None, 15, "signal", "pid 7 was killed by SIGTERM")),
        ((None, None, {"how": "signal", "signal": 2, "exception": "KeyboardInterrupt"}, True),
         (None, 2, "signal", "pid 7 was interrupted (KeyboardInterrupt): Python ended it "
                             "with SIGINT")),
    ]
    for (status, sig, ae, served), want in cases:
        ex = describe_exit(7, status, sig, ae, served, 1)
        assert (ex.status, ex.signal, ex.how, ex.line) == want
