import pytest
import torch


@pytest.fixture(autouse=True)
def no_leftover_hooks():
    """Every test must leave torch's global hooks as it found them."""
    import torch.nn.modules.module as mm
    import torch.optim.optimizer as oo
    before = (len(mm._global_forward_pre_hooks), len(mm._global_forward_hooks),
              len(oo._global_optimizer_pre_hooks), len(oo._global_optimizer_post_hooks),
              len(mm._global_module_registration_hooks))
    yield
    # a test that starts a recording and abandons it (the Recorder's own tests) leaves the
    # recording's module annotator (gpumon/agent/modules.py) on: stop it as the recording's end
    # would, so its global hooks don't count against the next test
    import sys
    mod = sys.modules.get("gpumon.agent.modules")
    if mod is not None:
        mod.annotate_stop()
    after = (len(mm._global_forward_pre_hooks), len(mm._global_forward_hooks),
             len(oo._global_optimizer_pre_hooks), len(oo._global_optimizer_post_hooks),
             len(mm._global_module_registration_hooks))
    assert after == before


@pytest.fixture
def seed():
    torch.manual_seed(0)
