import pytest
import torch


@pytest.fixture(autouse=True)
def no_leftover_hooks():
    """Every test must leave torch's global hooks as it found them."""
    import torch.nn.modules.module as mm
    import torch.optim.optimizer as oo
    before = (len(mm._global_forward_pre_hooks), len(mm._global_forward_hooks),
              len(oo._global_optimizer_pre_hooks), len(oo._global_optimizer_post_hooks))
    yield
    after = (len(mm._global_forward_pre_hooks), len(mm._global_forward_hooks),
             len(oo._global_optimizer_pre_hooks), len(oo._global_optimizer_post_hooks))
    assert after == before


@pytest.fixture
def seed():
    torch.manual_seed(0)
