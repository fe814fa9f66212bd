"""The pure breakdown model and the advice rules, each rule both ways."""
from gpumon.model.advice import advise
from gpumon.model.breakdown import BreakdownModel

G = 1024 ** 3


def bd(peak_phase, at_peak, now=None, allocated=10 * G, reserved=11 * G, retries=0, run_peak=None):
    return {"type": "event", "kind": "breakdown", "step": 3, "phase": "other", "devices": [{
        "index": 0, "now": now or dict(at_peak), "at_peak": at_peak,
        "peak": run_peak or sum(v for k, v in at_peak.items() if k in (
            "parameters", "gradients", "optimizer_state", "activations")),
        "peak_phase": peak_phase, "peak_step": 2, "peak_exact": True,
        "run_peak": run_peak or sum(v for k, v in at_peak.items() if k in (
            "parameters", "gradients", "optimizer_state", "activations")),
        "run_peak_phase": peak_phase, "run_peak_step": 1, "allocated": allocated,
        "reserved": reserved, "retries": retries}]}


def step_ev(n, optimizers=("AdamW",), impl=("foreach",), output_bytes=None, autocast=None):
    return {"type": "event", "kind": "step", "step": n, "time_s": 0.2, "peak": 5 * G,
            "peak_phase": "optimizer", "peak_exact": True, "peak_device": 0,
            "phases": {"forward": {"time_s": 0.1, "count": 1}}, "boundaries": [],
            "optimizers": list(optimizers), "optimizer_impl": list(impl),
            "output_bytes": output_bytes, "autocast": autocast, "phases_note": None}


def model(*msgs):
    m = BreakdownModel()
    for x in msgs:
        m.feed(x)
    return m


OPT_PEAK = {"parameters": 6 * G, "gradients": 6 * G, "optimizer_state": 12 * G,
            "activations": 6 * G, "allocator_cache": G // 4, "non_pytorch": None}
ACT_PEAK = {"parameters": 6 * G, "gradients": 0, "optimizer_state": 12 * G,
            "activations": 30 * G, "allocator_cache": G // 4, "non_pytorch": None}


def titles(m, **kw):
    return [a.title for a in advise(m, **kw)]


def test_model_folds_steps_and_breakdowns():
    m = model(step_ev(1), bd("optimizer", OPT_PEAK))
    assert m.steps[-1].step == 1 and m.steps[-1].peak_phase == "optimizer"
    d = m.main_device()
    assert d.peak_phase == "optimizer" and d.at_peak["optimizer_state"] == 12 * G


def test_non_pytorch_filled_from_samples():
    sample = {"type": "sample", "phase": "forward", "step": 3,
              "devices": [{"index": 0, "allocated": 9 * G, "proc_used": 14 * G}]}
    m = model(sample, bd("optimizer", OPT_PEAK))
    assert m.main_device().now["non_pytorch"] == 3 * G
    assert m.sampled_peak(3, "forward", 0) == 9 * G


def test_inexact_step_peak_refined_by_samples():
    s = {"type": "sample", "phase": "forward", "step": 4,
         "devices": [{"index": 0, "allocated": 7 * G}]}
    e = dict(step_ev(4), peak_exact=False, peak=6 * G, peak_phase="optimizer",
             phases={"forward": {}, "optimizer": {}})
    m = model(s, e)
    # a better lower bound from the samples, and still no phase: a bound says nothing of
    # where the step's true peak was (the agent's "optimizer" here came from an old agent)
    assert m.steps[-1].peak == 7 * G and m.steps[-1].peak_phase is None
    assert m.steps[-1].peak_exact is False


def test_advice_is_built_on_exact_figures_only():
    e = bd("forward", ACT_PEAK)
    dev = e["devices"][0]
    dev["run_peak_phase"] = None      # the high-water mark was set in an unmeasured step
    dev["at_run_peak"] = None
    dev["peak_exact"] = False         # and no step was measured exactly
    assert not any("activations dominate" in t for t in titles(model(step_ev(1), e)))
    dev["peak_exact"] = True          # the last exact step: activations dominate there
    assert any("activations dominate" in t for t in titles(model(step_ev(1), e)))


def test_fused_advice_only_for_optimizer_peak_with_foreach():
    assert any("fused" in t for t in titles(model(step_ev(1), bd("optimizer", OPT_PEAK))))
    assert not any("fused" in t for t in titles(model(step_ev(1), bd("forward", ACT_PEAK))))
    # already fused or for-loop, or an optimizer without foreach: nothing to gain
    for impl in ("fused", "for-loop", None):
        assert not any("fused" in t for t in titles(
            model(step_ev(1, impl=(impl,)), bd("optimizer", OPT_PEAK)))), impl
    # no temporaries beyond the model states at the peak: nothing to save
    none_left = dict(OPT_PEAK, activations=0)
    assert not any("fused" in t for t in titles(model(step_ev(1), bd("optimizer", none_left))))


def test_advice_uses_the_run_peak_roles():
    e = bd("optimizer", OPT_PEAK)
    dev = e["devices"][0]
    dev["at_peak"] = dict(ACT_PEAK)  # the last step's (inexact) peak says forward ...
    dev["peak_phase"] = "forward"
    dev["at_run_peak"] = dict(OPT_PEAK)  # ... the run's exact peak is in the optimizer step
    ts = titles(model(step_ev(1), e))
    assert any("fused" in t for t in ts) and not any("activations dominate" in t for t in ts)


def test_activation_advice_only_when_activations_dominate():
    assert any("activations" in t for t in titles(model(step_ev(1), bd("forward", ACT_PEAK))))
    assert not any("activations dominate" in t
                   for t in titles(model(step_ev(1), bd("optimizer", OPT_PEAK))))



def test_autocast_suggested_only_when_the_forward_ran_without_it():
    def act_advice(*evs):
        return [a for a in advise(model(*evs, bd("forward", ACT_PEAK)))
                if "activations dominate" in a.title][0]
    for off in (act_advice(step_ev(1)), act_advice(step_ev(1, autocast=False))):
        assert "autocast" in off.title and "bf16 autocast" in off.saving
    on = act_advice(step_ev(1, autocast="bfloat16"))
    assert "autocast" not in on.title and "autocast" not in on.saving
    assert "bfloat16 autocast already" in on.trigger
    # an unmeasured step (null) keeps what the last measured one said
    on = act_advice(step_ev(1, autocast="bfloat16"), step_ev(2, autocast=None))
    assert "autocast" not in on.title


def test_chunked_loss_only_for_large_logits():
    m = model(step_ev(1), bd("forward", ACT_PEAK))
    assert any("chunks" in t for t in titles(m, logits_bytes=10 * G))
    assert not any("chunks" in t for t in titles(m, logits_bytes=G // 10))
    assert not any("chunks" in t for t in titles(m))
    # measured by the agent: the model's output size
    assert any("chunks" in t for t in titles(model(step_ev(1, output_bytes=8 * G),
                                                   bd("forward", ACT_PEAK))))
    assert not any("chunks" in t for t in titles(model(step_ev(1, output_bytes=G),
                                                       bd("forward", ACT_PEAK))))
    # large logits but the peak is in the optimizer step: chunking would not lower it
    assert not any("chunks" in t for t in titles(model(step_ev(1, output_bytes=8 * G),
                                                       bd("optimizer", OPT_PEAK))))


def test_expandable_segments_when_reserved_far_above_peak_or_retries_rise():
    # peak 30 GiB; reserved 36 GiB: 6 GiB never allocated at once (fragmentation)
    m = model(step_ev(1), bd("optimizer", OPT_PEAK, allocated=24 * G, reserved=36 * G))
    adv = [a for a in advise(m) if "expandable" in a.title]
    assert adv and "6.0 GiB" in adv[0].saving
    m = model(step_ev(1), bd("optimizer", OPT_PEAK, allocated=24 * G, reserved=31 * G))
    assert not any("expandable" in t for t in titles(m))
    # a large cache now (between steps, the freed activations) is no sign of trouble
    now = dict(OPT_PEAK, activations=0, allocator_cache=12 * G)
    m = model(step_ev(1), bd("optimizer", OPT_PEAK, now=now, allocated=18 * G, reserved=31 * G))
    assert not any("expandable" in t for t in titles(m))
    m = model(step_ev(1), bd("optimizer", OPT_PEAK, allocated=24 * G, reserved=24 * G + G // 4,
                            retries=1),
              bd("optimizer", OPT_PEAK, allocated=24 * G, reserved=24 * G + G // 4, retries=3))
    assert any("expandable" in t for t in titles(m))


def test_non_pytorch_advice_only_when_large():
    s = {"type": "sample", "phase": "forward", "step": 3,
         "devices": [{"index": 0, "allocated": 9 * G, "proc_used": 15 * G}]}
    assert any("non-PyTorch" in t for t in titles(model(s, bd("optimizer", OPT_PEAK))))
    s["devices"][0]["proc_used"] = 11 * G + G // 2
    assert not any("non-PyTorch" in t for t in titles(model(s, bd("optimizer", OPT_PEAK))))


def test_no_advice_without_figures():
    assert advise(BreakdownModel()) == []


def test_model_keeps_how_many_steps_are_measured():
    assert model(step_ev(1)).measured_every == 1  # older agents: every step
    assert model(step_ev(1), {**step_ev(64), "measured_every": 64}).measured_every == 64
    assert model({**step_ev(2), "measured_every": "x"}).measured_every == 1
