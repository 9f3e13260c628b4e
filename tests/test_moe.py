"""The MoE layer against a token-by-token reference, and its losses against transformers'."""

from __future__ import annotations

import math

import pytest
import torch

from hpcllm import kernels
from hpcllm.model import moe
from hpcllm.model.moe import MoE, bias_update, capacity_of, take_aux_losses

H, E, FFN = 16, 4, 24


def _layer(router: str, activation: str = "swiglu", **kw) -> MoE:
    torch.manual_seed(0)
    layer = MoE(
        H,
        E,
        kw.pop("top_k", 2),
        FFN,
        activation=activation,
        group=None,
        gen=torch.Generator().manual_seed(3),
        init_std=0.5,
        out_std=0.3,
        router=router,
        **kw,
    ).double()
    if activation == "gelu":  # non-zero biases, so that a wrong bias shows
        with torch.no_grad():
            for ex in filter(None, (layer.experts, layer.shared)):
                ex.fc_bias.normal_(0, 0.2)
                ex.proj_bias.normal_(0, 0.2)
    return layer


def _expert(layer: MoE, e: int, x: torch.Tensor, ex: moe.Experts | None = None) -> torch.Tensor:
    """Expert e's MLP of one token (the activations are the model's ops, which compute in
    fp32 whatever their inputs: the reference checks routing, dispatch and combination)."""
    ex = ex or layer.experts
    if ex.activation == "swiglu":
        return kernels.swiglu(ex.gate[e] @ x, ex.up[e] @ x) @ ex.proj[e].t()
    return kernels.bias_gelu(ex.fc[e] @ x, ex.fc_bias[e]) @ ex.proj[e].t() + ex.proj_bias[e]


def _choose(layer: MoE, logits: torch.Tensor) -> list[tuple[int, torch.Tensor]]:
    """One token's (expert, weight) choices, by the router's definition, in rank order."""
    k = layer.top_k
    if layer.router_kind == "sigmoid":
        scores = logits.sigmoid()
        bias = layer.bias if layer.bias is not None else torch.zeros_like(scores)
        order = sorted(range(E), key=lambda e: -(scores[e].item() + bias[e].item()))[:k]
        weights = [scores[e] for e in order]
        if layer.renormalize:
            total = sum(weights)
            weights = [w / total for w in weights]
        return list(zip(order, weights, strict=True))
    order = sorted(range(E), key=lambda e: -logits[e].item())[:k]
    if layer.router_kind == "topk-softmax":
        top = torch.stack([logits[e] for e in order])
        return list(zip(order, top.softmax(0), strict=True))
    probs = logits.softmax(0)
    weights = [probs[e] for e in order]
    if layer.renormalize:
        total = sum(weights)
        weights = [w / total for w in weights]
    return list(zip(order, weights, strict=True))


def _reference(layer: MoE, x: torch.Tensor) -> torch.Tensor:
    """The layer's output, token by token: route, keep what fits each expert, sum."""
    b, s, h = x.shape
    tokens = x.reshape(-1, h)
    # The router runs in fp32 whatever the layer's dtype, as the layer's does.
    choices = [_choose(layer, layer.router.weight.float() @ t.float()) for t in tokens]
    capacity = capacity_of(layer.capacity_factor, layer.top_k, len(tokens), E)
    keep = {(i, j) for i, c in enumerate(choices) for j in range(len(c))}
    if capacity is not None:
        for e in range(E):
            mine = [(i, j) for i, c in enumerate(choices) for j, (ce, _) in enumerate(c) if ce == e]
            if layer.drop_policy == "probs":
                mine.sort(key=lambda ij: (-choices[ij[0]][ij[1]][1].item(), ij[0]))
            for ij in mine[capacity:]:
                keep.discard(ij)
    out = []
    for i, token in enumerate(tokens):
        y = torch.zeros(h, dtype=x.dtype)
        for j, (e, w) in enumerate(choices[i]):
            if (i, j) in keep:
                y = y + w * _expert(layer, e, token)
        if layer.shared is not None:
            gate = 1.0
            if layer.shared_gate is not None:
                gate = (layer.shared_gate.weight[0] @ token).sigmoid()
            y = y + gate * _expert(layer, 0, token, layer.shared)
        out.append(y)
    return torch.stack(out).view(b, s, h)


CASES = [
    ("softmax-topk", {}),
    ("softmax-topk", {"renormalize": True}),
    ("softmax-topk", {"renormalize": True, "shared_ffn": 8, "shared_gate": True}),  # Qwen
    ("topk-softmax", {}),
    ("topk-softmax", {"shared_ffn": 8}),
    ("sigmoid", {}),
    ("sigmoid", {"renormalize": True}),
]


# make unit runs the dropless SwiGLU case of each router; make test every one.
SLOW = pytest.mark.slow


@pytest.mark.parametrize("activation", ["swiglu", pytest.param("gelu", marks=SLOW)])
@pytest.mark.parametrize("router, extra", CASES)
@pytest.mark.parametrize(
    "capacity, policy",
    [
        (None, "probs"),
        pytest.param(1.0, "probs", marks=SLOW),
        pytest.param(1.0, "position", marks=SLOW),
        pytest.param(0.5, "probs", marks=SLOW),
        pytest.param(0.5, "position", marks=SLOW),
    ],
)
def test_the_layer_equals_a_token_by_token_reference(router, extra, activation, capacity, policy):
    layer = _layer(
        router, activation, capacity_factor=capacity, drop_policy=policy, aux_loss=0.0, **extra
    )
    if router == "sigmoid":
        with torch.no_grad():
            layer.bias.copy_(torch.tensor([0.3, -0.2, 0.0, 0.1], dtype=torch.float64))
    x = torch.randn(2, 5, H, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    x1, x2 = x.clone().requires_grad_(), x.clone().requires_grad_()
    y, bias = layer(x1)
    assert bias is None
    want = _reference(layer, x2)
    # Within 1e-6 of the largest output: the router's fp32 logits, summed in another order
    # (a whole batch against one token), differ in their last bit.
    torch.testing.assert_close(y, want, rtol=1e-6, atol=1e-6 * want.abs().max().item())
    # Gradients of a loss through both: inputs and every weight.
    weights = torch.randn_like(y)
    grads = torch.autograd.grad((y * weights).sum(), [x1, *layer.parameters()], allow_unused=True)
    wants = torch.autograd.grad(
        (want * weights).sum(), [x2, *layer.parameters()], allow_unused=True
    )
    for got, expected in zip(grads, wants, strict=True):
        if expected is None:
            assert got is None or not got.abs().sum()
        else:
            scale = expected.abs().max().item()
            torch.testing.assert_close(got, expected, rtol=1e-6, atol=1e-6 * scale)
    if capacity is not None:
        dropped = layer.stats.dropped.item()
        slots = capacity_of(capacity, 2, 10, E)
        assert dropped >= max(0.0, 1 - E * slots / 20) - 1e-6  # at least what cannot fit


def test_capacity_drops_the_policys_choice():
    # Four tokens all to expert 0 and 1 (top-2 of 4 experts), one slot each: `position` keeps
    # the first token, `probs` the one with the largest weight.
    layer = _layer("softmax-topk", capacity_factor=0.5, drop_policy="position")
    assert capacity_of(0.5, 2, 4, E) == 1
    experts = torch.tensor([[0, 1], [0, 1], [1, 0], [0, 1]])
    weights = torch.tensor([[0.5, 0.1], [0.9, 0.05], [0.6, 0.3], [0.7, 0.2]])
    by_position = moe.kept(experts, weights, E, 1, "position")
    assert by_position.tolist() == [[True, True], [False, False], [False, False], [False, False]]
    by_probs = moe.kept(experts, weights, E, 1, "probs")
    assert by_probs.tolist() == [[False, False], [True, False], [True, False], [False, False]]
    del layer


def test_a_renormalised_top1_is_refused():
    with pytest.raises(ValueError, match="renormalised top-1"):
        _layer("softmax-topk", top_k=1, renormalize=True)


def _transformers_balance(logits: torch.Tensor, top_k: int) -> torch.Tensor:
    from transformers.models.mixtral.modeling_mixtral import load_balancing_loss_func

    return load_balancing_loss_func((logits,), E, top_k)


@pytest.mark.slow  # importing transformers takes seconds
@pytest.mark.parametrize("router", ["softmax-topk", "topk-softmax"])
@pytest.mark.parametrize("top_k", [1, 2])
def test_the_balancing_loss_is_transformers_for_one_layer(router, top_k):
    gen = torch.Generator().manual_seed(5)
    logits = torch.randn(37, E, generator=gen, requires_grad=True)  # fp32, as routers are
    routing = moe.route(logits, router, top_k, renormalize=False)
    counts = moe.expert_counts(routing.experts, E)
    ours = moe.balance_loss(routing.probs.sum(0), counts, 37, E)
    theirs = _transformers_balance(logits, top_k)
    torch.testing.assert_close(ours, theirs, rtol=1e-6, atol=0)
    (g_ours,) = torch.autograd.grad(ours, logits)
    (g_theirs,) = torch.autograd.grad(theirs, logits)
    torch.testing.assert_close(g_ours, g_theirs, rtol=1e-6, atol=1e-6 * g_theirs.abs().max().item())


def _router_grad(layer: MoE, x: torch.Tensor, scale: float, explicit: bool) -> torch.Tensor:
    """The router's gradient of scale · (main + 0.1·balance + 0.01·z): through the losses the
    layer leaves (backpropagated beside the output with the main loss's scale, as the step
    does), or (``explicit``) with the layer's off and the losses written out."""
    layer.zero_grad()
    layer.aux_loss, layer.z_loss = (0.0, 0.0) if explicit else (0.1, 0.01)
    y, _ = layer(x)
    loss = 1e-3 * y.sum()  # small: the auxiliary losses dominate the router's gradient
    if explicit:
        logits = x.reshape(-1, H).float() @ layer.router.weight.float().t()
        routing = moe.route(logits, "softmax-topk", 2, False)
        counts = moe.expert_counts(routing.experts, E)
        balance = moe.balance_loss(routing.probs.sum(0), counts, 10, E)
        z = logits.logsumexp(-1).square().mean()
        loss = loss + 0.1 * balance + 0.01 * z
        assert layer.stats.balance.item() == pytest.approx(balance.item())
        assert layer.stats.z.item() == pytest.approx(z.item())
    aux = take_aux_losses([layer])
    assert layer.aux is None
    roots, grads = [scale * loss], [None]
    if aux is not None:
        roots.append(aux)
        grads.append(torch.tensor(scale, dtype=aux.dtype))
    torch.autograd.backward(roots, grads)
    return layer.router.weight.grad.clone()


def test_the_sigmoid_bias_moves_toward_the_mean_load_and_only_chooses():
    layer = _layer("sigmoid", top_k=1)
    x = torch.randn(4, 8, H, dtype=torch.float64, generator=torch.Generator().manual_seed(4))
    layer(x)
    layer(x)  # two micro-batches of one step
    load = layer.step_counts.clone()
    assert load.sum() == 2 * 32
    bias_update(layer, 0.001)
    want = 0.001 * torch.sign(load.double().mean() - load.double())
    torch.testing.assert_close(layer.bias, want.to(layer.bias.dtype))
    assert layer.step_counts is None
    # The bias picks experts; the weights stay the scores.
    logits = torch.tensor([[0.0, 1.0, 0.5, -1.0]], dtype=torch.float64)
    picked = moe.route(logits, "sigmoid", 1, False, torch.tensor([2.0, 0, 0, 0]).double())
    assert picked.experts.item() == 0
    assert picked.weights.item() == pytest.approx(0.5)  # sigmoid(0), not shifted


def test_capacity_of_counts_the_micro_batch():
    assert capacity_of(None, 2, 100, 8) is None
    assert capacity_of(1.0, 2, 100, 8) == 25
    assert capacity_of(1.25, 2, 100, 8) == math.ceil(31.25)


@pytest.mark.parametrize(
    "arch, sets",
    [
        ("gpt2", ["model.preset=tiny"]),
        (
            "llama",
            [
                "model.preset=llama-tiny",
                "model.moe_every=2",
                "model.moe_ffn_size=48",
                "model.moe_shared_ffn_size=32",
                "model.moe_shared_gate=true",
            ],
        ),
    ],
)
def test_the_moe_flops_are_a_count_of_the_models_matmuls(arch, sets):
    from torch.utils.flop_counter import FlopCounterMode

    from hpcllm.config import load_config
    from hpcllm.flops import model_step_flops, moe_flops_delta

    base = [f"model.arch={arch}", *sets, "model.seq_len=16"]
    dense = load_config(None, base).model
    sparse = load_config(None, [*base, "model.moe_experts=4", "model.moe_top_k=2"]).model
    ids = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(0))
    counted = []
    for cfg in (dense, sparse):
        model = families_model(cfg, 128)
        for layer in moe.layers_of(model):  # the counter knows no formula of grouped GEMMs
            layer.grouped = False
        with FlopCounterMode(display=False) as counter:
            model(ids, ids)
        counted.append(counter.get_total_flops())
    forward = moe_flops_delta(sparse, 2) / 3  # a step is 3 forwards' worth
    assert counted[1] - counted[0] == pytest.approx(forward, rel=1e-9)
    assert moe_flops_delta(sparse, 2, "full") == pytest.approx(4 * forward)
    assert model_step_flops(sparse, 2, 128) == pytest.approx(
        model_step_flops(dense, 2, 128) + 3 * forward
    )


def families_model(cfg, vocab: int) -> torch.nn.Module:
    from hpcllm import families

    return families.model_class(cfg.arch)(cfg, vocab)


@pytest.mark.parametrize("activation", ["swiglu", "gelu"])
def test_the_grouped_gemm_and_the_loop_over_experts_agree(activation):
    # torch 2.13's CPU build runs grouped GEMMs in fp32 (not fp64): the path under test.
    assert moe.grouped_mm_works(torch.device("cpu"), torch.float32)
    layer = _layer("softmax-topk", activation, capacity_factor=1.0, shared_ffn=8).float()
    x = torch.randn(2, 6, H, generator=torch.Generator().manual_seed(7))
    dy = torch.randn(2, 6, H, generator=torch.Generator().manual_seed(8))
    results = []
    for grouped in (True, False):
        layer.grouped = grouped
        layer.zero_grad()
        y, _ = layer(x)
        (y * dy).sum().backward()
        results.append([y.detach(), *(p.grad.clone() for p in layer.parameters())])
    for a, b in zip(*results, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5 * b.abs().max().item())


def test_the_grouped_gemm_probe_inside_a_recomputed_forward_leaves_the_checkpoint_whole():
    # The first forward ever asks whether the grouped GEMM runs; asked inside a checkpointed
    # forward, the probe's saved tensors once made the recomputation's count differ.
    from torch.utils.checkpoint import checkpoint

    layer = _layer("softmax-topk").float()
    x = torch.randn(2, 6, H, requires_grad=True)
    moe._GROUPED.clear()
    out = checkpoint(lambda t: layer(t)[0], x, use_reentrant=False)
    out.sum().backward()
    assert x.grad is not None and moe._GROUPED


def _two_ranks(layers: list[MoE], xs: list[torch.Tensor]) -> list[torch.Tensor]:
    """Run two MoE layers (ep ranks 0 and 1) at once in threads, their all-to-all a swap
    through shared slots; return each one's output."""
    import threading

    barrier = threading.Barrier(2, timeout=30)  # a rank skipping an all-to-all: an error
    slots: dict[tuple[int, int], torch.Tensor] = {}

    def all_to_all_of(rank: int):
        def run(x: torch.Tensor, send: list[int], recv: list[int]) -> torch.Tensor:
            for dest, part in enumerate(torch.split(x, send)):
                slots[rank, dest] = part.clone()
            barrier.wait()
            got = [slots[source, rank] for source in range(2)]
            assert [len(g) for g in got] == recv
            barrier.wait()
            return torch.cat(got)

        return run

    outs: list = [None, None]
    calls = [0, 0]

    def work(rank: int) -> None:
        inner = all_to_all_of(rank)

        def counted(*args: object) -> torch.Tensor:
            calls[rank] += 1
            return inner(*args)

        layers[rank].ep.all_to_all = counted
        y = layers[rank](xs[rank])[0]
        y.pow(2).sum().backward()
        outs[rank] = y

    threads = [threading.Thread(target=work, args=(r,)) for r in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    # The counts, the rows there and back, and the two backwards: alike on both ranks.
    assert calls == [5, 5], calls
    return outs


@pytest.mark.parametrize("activation", ["swiglu", "gelu"])
def test_experts_split_over_two_ep_ranks_give_the_whole_layers_outputs_and_gradients(activation):
    # Each rank holds two of the four experts, drawn as the whole layer draws them; the
    # tokens travel to them and back in their order, and each expert's gradient sums both
    # ranks' tokens (what the engine then averages over expert-dp).
    whole = _layer("softmax-topk", activation)
    parts = [_layer("softmax-topk", activation, ep=moe.ExpertParallel(2, r)) for r in range(2)]
    if activation == "gelu":  # _layer's random biases, as the whole layer has them
        with torch.no_grad():
            for r, part in enumerate(parts):
                part.experts.fc_bias.copy_(whole.experts.fc_bias[2 * r : 2 * r + 2])
                part.experts.proj_bias.copy_(whole.experts.proj_bias)
    for r, part in enumerate(parts):
        for name in ("gate", "up", "fc", "fc_bias", "proj"):
            if getattr(whole.experts, name) is not None:
                mine = getattr(whole.experts, name)[2 * r : 2 * r + 2]
                assert torch.equal(getattr(part.experts, name), mine), (r, name)
    xs = [torch.randn(2, 5, H, dtype=torch.float64, generator=torch.Generator().manual_seed(r))
          for r in range(2)]  # fmt: skip
    outs = _two_ranks(parts, [x.clone().requires_grad_() for x in xs])
    for r in range(2):
        y = whole(xs[r])[0]
        torch.testing.assert_close(outs[r], y, rtol=1e-12, atol=1e-12)
        y.pow(2).sum().backward()  # the whole layer's gradient: both ranks' tokens summed
    for r, part in enumerate(parts):
        for name, p in part.experts.named_parameters():
            if name == "proj_bias":  # whole on every rank: its gradient is each rank's tokens'
                continue
            torch.testing.assert_close(
                p.grad, getattr(whole.experts, name).grad[2 * r : 2 * r + 2], rtol=1e-10, atol=1e-12
            )


@pytest.mark.parametrize("grouped", [True, False])
def test_an_ep_rank_whose_experts_get_no_token_still_runs_the_backwards_all_to_alls(grouped):
    # The sigmoid router's balancing bias sends every token to experts 0 and 1, both on ep
    # rank 0: rank 1 receives no row, and (in the loop) makes no expert output at all.
    def biased(layer: MoE) -> MoE:
        layer.grouped = grouped
        layer.bias.copy_(torch.tensor([50.0, 50.0, -50.0, -50.0], dtype=layer.bias.dtype))
        return layer

    whole = biased(_layer("sigmoid", renormalize=True))
    parts = [biased(_layer("sigmoid", renormalize=True, ep=moe.ExpertParallel(2, r)))
             for r in range(2)]  # fmt: skip
    xs = [torch.randn(2, 5, H, dtype=torch.float64, generator=torch.Generator().manual_seed(r))
          for r in range(2)]  # fmt: skip
    inputs = [x.clone().requires_grad_() for x in xs]
    outs = _two_ranks(parts, inputs)
    for r in range(2):
        x = xs[r].clone().requires_grad_()
        y = whole(x)[0]
        y.pow(2).sum().backward()
        torch.testing.assert_close(outs[r], y, rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(inputs[r].grad, x.grad, rtol=1e-10, atol=1e-12)
