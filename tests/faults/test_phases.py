"""Issue 22, item 1: phases_breakdown, asked for back to back, killed the training program
with SIGSEGV (5 runs of 7; after 35 to 845 requests): the command read gradients and optimizer
state on the agent's thread while the training thread freed them. The phases part reads tensors
only on the training thread; this case asks as fast as the agent allows, from several clients,
during a real AdamW loop, and checks the program is unharmed."""
import threading
import time

from .harness import Raw, unharmed


def test_phases_breakdown_back_to_back_during_training_never_hurts_the_program(victims, tmp_path):
    v = victims(torch_loop=True, rate=10)
    end = time.monotonic() + 3.0
    answered = []

    def hammer(k):
        try:
            r = Raw(v.sock)
        except OSError:
            return
        n, mid = 0, 0
        while time.monotonic() < end:
            mid += 1
            try:
                rep = r.request("phases_breakdown", mid=mid, timeout=10)  # paced as told
            except (OSError, AssertionError):
                break  # the agent (or the program) went away
            n += bool(rep.get("ok"))
        answered.append(n)
        r.close()

    ts = [threading.Thread(target=hammer, args=(k,)) for k in range(8)]
    for t in ts:
        t.start()
    for t in ts:
        t.join(30)
    assert v.alive(), f"the program died: status {v.proc.returncode}"
    assert sum(answered) >= 40, answered  # the case did ask, and was answered
    v.finish()
    ok, why = unharmed(v, tmp_path)
    assert ok, why
