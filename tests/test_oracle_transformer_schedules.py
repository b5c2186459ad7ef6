"""The pipeline schedules priced in the transformer oracle: each closed form equals the replay of lab 17's op
lists with the same F, B and W times; F, B and W of a transformer layer; the memory of the op lists; the search
choosing zero bubble where it pays and not where memory binds."""

from __future__ import annotations

import pytest
from ddlab.oracle.published import H100_SXM, LLAMA3_70B, gpu_platform
from ddlab.oracle.schedules import (
    ZB_V_LIMIT,
    idle_per_rank,
    in_flight,
    op_lists,
    replayed_idle,
    split_flops,
)
from ddlab.oracle.transformer import GPT, Layout, iteration_flops, layout_time, predict, problem, stage_op_times
from ddlab.oracle.transformer_planner import plan_transformer, search
from ddlab.pipeline import bubble, interleaved_1f1b, simulate_interleaved

TIMES = [(1.0, 1.0, 1.0), (1.0, 2.0, 1.0), (1.0, 1.5, 0.5), (1.0, 1.0, 0.2), (2.0, 1.0, 1.0), (1.0, 1.0, 2.0)]


@pytest.mark.parametrize("f, b, w", TIMES)
@pytest.mark.parametrize("p", [2, 3, 4, 5])
def test_each_closed_form_is_the_replay_of_its_op_list(p, f, b, w):
    for m in (p, p + 1, 2 * p, 2 * p + 1, 3 * p):
        assert idle_per_rank("1f1b", p, m, f, b, w) == pytest.approx(replayed_idle("1f1b", p, m, f, b, w))
        assert idle_per_rank("zb-h1", p, m, f, b, w) == pytest.approx(replayed_idle("zb-h1", p, m, f, b, w))
        if m >= 2 * p:
            assert idle_per_rank("zb-h2", p, m, f, b, w) == pytest.approx(replayed_idle("zb-h2", p, m, f, b, w))
    for m in (1, p - 1, p + 1):  # below a closed form's range the replay is the price
        if m >= 1:
            assert idle_per_rank("zb-h2", p, m, f, b, w) == pytest.approx(replayed_idle("zb-h2", p, m, f, b, w))
            assert idle_per_rank("zb-v", p, m, f, b, w) == pytest.approx(replayed_idle("zb-v", p, m, f, b, w))


@pytest.mark.parametrize("p, v", [(2, 2), (3, 2), (4, 2), (4, 3)])
def test_the_interleaved_bubble_is_its_replay(p, v):
    for m in (p, 2 * p, 3 * p):
        for f, b, w in TIMES[:3]:
            replay = simulate_interleaved([interleaved_1f1b(p, m, r, v) for r in range(p)], v, f, b + w)
            idle = idle_per_rank("1f1b", p, m, f, b, w, v)
            assert idle / (m * (f + b + w) + idle) == pytest.approx(bubble(replay))


def test_the_papers_figures_at_equal_times():
    """Qi et al. 2024 (sections 2.1-2.2): at F = B = W, ZB-H1 idles a third of 1F1B; ZB-H2 and ZB-V only the start-up
    (p - 1 forwards, half as long in a V's chunks) with every rank's step ending together."""
    p, m = 4, 16
    assert idle_per_rank("zb-h1", p, m, 1, 1, 1) == pytest.approx(idle_per_rank("1f1b", p, m, 1, 1, 1) / 3)
    assert idle_per_rank("zb-h2", p, m, 1, 1, 1) == pytest.approx(p - 1)
    assert idle_per_rank("zb-v", p, m, 1, 1, 1) == pytest.approx((p - 1) / 2)
    assert idle_per_rank("zb-h1", 1, 5, 1, 2, 1) == 0.0  # one stage never waits


def test_memory_is_the_op_lists_micro_batches_alive():
    p = 4
    for m in (2, 4, 8, 16):
        assert in_flight("1f1b", p, m, 0) == min(p, m) == in_flight("zb-h1", p, m, 0)
    assert in_flight("zb-h2", p, 16, 0) == 2 * p  # 2p - 1 warm-up forwards, then one more before the first B
    assert in_flight("zb-v", p, 16, 0) == 2 * p  # chunks of l/(2p) layers: 1F1B's p stages' worth
    assert len(op_lists("zb-v", p, 8)) == p


def test_bad_schedules_are_refused_with_what_to_do():
    with pytest.raises(ValueError, match="choose one of"):
        idle_per_rank("gpipe", 4, 8, 1, 1, 1)
    with pytest.raises(ValueError, match="use v = 1"):
        idle_per_rank("zb-h1", 4, 8, 1, 1, 1, v=2)
    with pytest.raises(ValueError, match="p m <="):
        idle_per_rank("zb-v", 64, ZB_V_LIMIT, 1, 1, 1)
    gpt = GPT(layers=12, hidden=256, heads=8, seq=512, vocab=1000)
    lay = Layout(data=2, pipeline=4, batch=16)
    assert "divide" in problem(gpt, lay.with_(pipeline=4, schedule="zb-v"))  # 12 layers into 2 x 4 chunks
    assert problem(gpt, lay.with_(pipeline=3, schedule="zb-v")) is None
    assert "interleave 1" in problem(gpt, lay.with_(schedule="zb-h1", interleave=3))
    assert "choose one of" in problem(gpt, lay.with_(schedule="dualpipe"))


@pytest.mark.parametrize("recompute", ["none", "selective", "full"])
def test_f_b_w_of_a_transformer_add_up_to_the_iterations_flops(recompute):
    gpt = LLAMA3_70B
    attention = gpt.layers * gpt.attention_score_flops()
    linear, output = gpt.forward_flops() - attention, 2.0 * gpt.seq * gpt.hidden * gpt.vocab
    f, b, w = split_flops(linear, attention, output, recompute)
    assert f + b + w == pytest.approx(iteration_flops(gpt, 1, recompute))
    rerun = {"none": 0.0, "selective": attention, "full": f - output}[recompute]
    assert w == linear + output and b - w == pytest.approx(2 * attention + rerun)


def test_the_oracle_prices_the_bubble_from_f_b_w():
    h100 = gpu_platform(H100_SXM)
    lay = Layout(data=2, tensor=4, pipeline=8, batch=32, precision="fp8", kernel="flash", sequence_parallel=True)
    plain = layout_time(LLAMA3_70B, lay, h100)
    m, compute = lay.micro_batches, plain["compute"]
    assert plain["bubble"] == pytest.approx(7 / m * compute)  # 1F1B: (p - 1)(f + b + w)
    for schedule in ("zb-h1", "zb-h2", "zb-v"):
        parts = layout_time(LLAMA3_70B, lay.with_(schedule=schedule), h100)
        f, b, w = stage_op_times(LLAMA3_70B, lay, h100, compute)
        assert f + b + w == pytest.approx(compute / m) and w < f < b  # B holds the attention's backward
        assert parts["compute"] == compute
        assert parts["bubble"] == pytest.approx(idle_per_rank(schedule, 8, m, f, b, w))
    h1 = layout_time(LLAMA3_70B, lay.with_(schedule="zb-h1"), h100)["bubble"]
    assert 0.3 * plain["bubble"] < h1 < 0.6 * plain["bubble"]  # F ~ B ~ W: about a third, plus the attention's B
    zb_v = layout_time(LLAMA3_70B, lay.with_(schedule="zb-v"), h100)
    assert zb_v["pipeline"] == pytest.approx(2 * plain["pipeline"])  # two chunks per rank: twice the messages


def test_zero_bubble_stops_paying_when_w_is_small():
    """Full recomputation adds the forward to B; a long sequence makes the attention (B only) the bulk: W's share
    shrinks, and so does what ZB-H1 saves over 1F1B."""
    h100 = gpu_platform(H100_SXM)
    lay = Layout(data=1, tensor=8, pipeline=8, batch=64, precision="fp8", kernel="flash", sequence_parallel=True)

    def saving(gpt: GPT, recompute: str) -> float:
        one = layout_time(gpt, lay.with_(recompute=recompute), h100)["bubble"]
        return 1 - layout_time(gpt, lay.with_(recompute=recompute, schedule="zb-h1"), h100)["bubble"] / one

    short, long = LLAMA3_70B, GPT(**{**LLAMA3_70B.__dict__, "seq": 131072})
    assert saving(short, "none") > 0.5 > saving(short, "full") > saving(long, "full") > 0


def test_the_search_takes_zero_bubble_where_it_pays_and_not_where_memory_binds():
    h100 = gpu_platform(H100_SXM)
    base = Layout(precision="fp8", kernel="flash", overlap=True, sequence_parallel=True, recompute="selective")
    plan = plan_transformer(LLAMA3_70B, 64, 128, h100, base=base, zero_stages=(1,), micro_batches=(1,))
    best = plan.best
    assert best is not None and best.layout.pipeline > 1 and best.layout.schedule == "zb-h1"
    one = best.layout.with_(schedule="1f1b")
    assert best.time < predict(LLAMA3_70B, one, h100).time
    # ZB-H2 would be faster still on this mesh, but its 2p micro-batches in flight do not fit in 80 GB
    h2 = best.layout.with_(schedule="zb-h2")
    assert predict(LLAMA3_70B, h2, h100).time < best.time
    assert any(lay == h2 and "out of memory" in why for lay, why in plan.rejected)

    def pick(budget: float) -> str:
        ranked = []
        for schedule in ("1f1b", "zb-h1", "zb-h2"):
            got = search(LLAMA3_70B, 64, one.with_(schedule=schedule), h100, budget)[0]
            ranked += [pred for pred in got if pred.layout.with_(schedule="1f1b") == one]
        return min(ranked, key=lambda pred: pred.time).layout.schedule

    assert pick(200 * 2**30) == "zb-h2"  # room for ZB-H2's micro-batches
    # at 1F1B's own peak: ZB-H1's last stage keeps p micro-batches (and the logits) where 1F1B keeps one
    assert pick(predict(LLAMA3_70B, one, h100).peak) == "1f1b"


def test_a_layout_without_a_pipeline_is_kept_once():
    gpt = GPT(layers=8, hidden=512, heads=8, seq=1024, vocab=1000)
    plan = plan_transformer(gpt, 4, 8, gpu_platform(H100_SXM), zero_stages=(0,), micro_batches=(1,))
    flat = [pred.layout for pred in plan.ranked if pred.layout.pipeline == 1]
    assert flat and len(flat) == len(set(flat)) and {lay.schedule for lay in flat} == {"1f1b"}
    assert {pred.layout.schedule for pred in plan.ranked if pred.layout.pipeline > 1} >= {"zb-h1", "zb-h2"}
