"""A launcher that restarts its rank (torchrun's elastic restarts give new pids): the client
follows the new process by itself, and says the old one ended."""
import os
import subprocess
import sys
import textwrap

from gpumon import client

from .conftest import JsonLines, gpumon_popen, wait_for

# Starts a rank (RANK=0, its agent by gpumon.start()), and starts it again each time it ends,
# twice in all; prints each rank's pid. A rank ends when the file named by its pid appears.
LAUNCHER = textwrap.dedent("""
    import os, subprocess, sys
    rank = (
        "import os, sys, time, gpumon\\n"
        "gpumon.start(rate_hz=20, source='simulated')\\n"
        "while not os.path.exists(os.path.join(sys.argv[1], str(os.getpid()))):\\n"
        "    time.sleep(0.02)\\n")
    for restart in range(2):
        env = dict(os.environ, RANK="0", LOCAL_RANK="0", WORLD_SIZE="1")
        k = subprocess.Popen([sys.executable, "-c", rank, sys.argv[1]], env=env)
        print(k.pid, flush=True)
        k.wait()
""")


def test_a_restarted_rank_is_followed_by_itself(tmp_path):
    launcher = subprocess.Popen([sys.executable, "-c", LAUNCHER, str(tmp_path)],
                                stdout=subprocess.PIPE, text=True,
                                env={k: v for k, v in os.environ.items() if k != "GPUMON"})
    try:
        first = int(launcher.stdout.readline())
        wait_for(lambda: client.scan().get(first), what="the first rank's agent")
        a = gpumon_popen("attach", launcher.pid, "--json")
        js = JsonLines(a)
        s = js.until(lambda m: m["type"] == "sample", what="the first rank's samples")
        assert (s["pid"], s["rank"]) == (first, 0)
        (tmp_path / str(first)).touch()  # the rank ends; the launcher starts it again
        ex = js.until(lambda m: m.get("kind") == "exit", what="the first rank's end")
        assert ex["pid"] == first and ex["rank"] == 0
        assert ex["how"] == "exit"  # through Python's shutdown (its status: the launcher's)
        second = int(launcher.stdout.readline())
        assert second != first
        s = js.until(lambda m: m["type"] == "sample" and m["pid"] == second,
                     what="the new rank's samples", timeout=60)
        assert s["rank"] == 0 and s["seq"] == 0  # its own stream, history first
        states = [(m["pid"], m["state"]) for m in js.seen if m.get("kind") == "state"]
        assert states == [(first, "serving"), (launcher.pid, "launcher"), (first, "exited"),
                          (second, "serving")]
        (tmp_path / str(second)).touch()  # the last run ends, then the launcher
        rest = js.rest(60)
        assert [(m["pid"], m["state"]) for m in rest if m.get("kind") == "state"] == [
            (second, "exited"), (launcher.pid, "exited")]
        assert a.wait(30) == 0
    finally:
        if launcher.poll() is None:
            launcher.kill()
        launcher.wait(30)
        launcher.stdout.close()


def test_once_on_a_launcher_says_why_another_pid_is_shown(tmp_path):
    """`gpumon attach 1 --once` (a new user's guess) printed another job's figures with no word
    of why: the pid named launched them. Now said once, on stderr."""
    from gpumon.client import procs

    from .conftest import gpumon
    launcher = subprocess.Popen([sys.executable, "-c", LAUNCHER, str(tmp_path)],
                                stdout=subprocess.PIPE, text=True)
    try:
        rank = int(launcher.stdout.readline())
        wait_for(lambda: client.discover(rank), what="the rank's agent")
        r = gpumon("attach", launcher.pid, "--once")
        assert r.returncode == 0 and r.stdout.startswith(f"pid {rank}  rank 0/1  "), r
        name = procs.name_of(launcher.pid)  # python or python3, as the venv names it
        assert r.stderr == (f"gpumon: pid {launcher.pid} ({name}) launched the processes shown: "
                            "their agents are followed\n"), r.stderr
        r = gpumon("attach", rank, "--once")  # the rank itself: nothing to explain
        assert r.returncode == 0 and r.stderr == "", r.stderr
        (tmp_path / str(rank)).touch()
        (tmp_path / str(int(launcher.stdout.readline()))).touch()
    finally:
        if launcher.poll() is None:
            launcher.kill()
        launcher.wait(30)
        launcher.stdout.close()
