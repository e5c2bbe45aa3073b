"""The student layer: a Gated DeltaNet with flash-linear-attention's parameter names and semantics
(fla.layers.GatedDeltaNet with use_gate=True, expand_v=1, num_v_heads=num_heads), in plain
PyTorch so it runs and initialises on CPU; the recurrence itself goes through tcal.kernels.

Differences from fla's layer, each on purpose: q/k/v/o projections may carry biases (teachers such
as Qwen have q/k/v biases and we keep them), the short convolutions are optional and start as the
identity (so weights copied from a teacher keep their meaning), and v's activation is selectable.
"""

from __future__ import annotations

import inspect
import math

import torch
import torch.nn as nn
import torch.nn.functional as F

from .delta_inputs import Projections, kernel_takes
from .gated_norm import ACTIVATIONS as GATE_ACTIVATIONS, OutputNorm, gated_rms_norm_triton, kernel_takes as gated_norm_takes
from .kernels import fla_available, gated_delta_rule, gated_delta_rule_from_projections
from .token_step import gdn_token_step, token_step_fits

V_ACTIVATIONS = {"silu": F.silu, "identity": lambda x: x}
TOKEN_STEP_V_SILU = {"silu": True, "identity": False}  # the v activations tcal.token_step fuses


def _fused_norms(x: torch.Tensor, backend: str) -> bool:
    """fla's fused norm kernels follow the layer's backend: "fla" always, "auto" for CUDA tensors
    when fla imports; "torch" (and every CPU run) keeps the eager float32 code. Under torch.compile
    the eager code is what inductor fuses into one kernel itself (fla's would break the graph)."""
    if torch.compiler.is_compiling():
        return False
    return backend == "fla" or (backend == "auto" and x.is_cuda and fla_available())


def l2norm(x: torch.Tensor, eps: float = 1e-6, backend: str = "torch") -> torch.Tensor:
    """fla's l2norm: x / sqrt(sum x^2 + eps) over the last dim, in float32.

    On CUDA with fla, fla's fused kernel (one pass instead of five elementwise ones: at 32k tokens
    the eager form costs more than the recurrence it feeds)."""
    if _fused_norms(x, backend):
        from fla.modules.norm.l2norm import l2norm as fla_l2norm

        return fla_l2norm(x, eps)
    xf = x.float()
    return (xf * torch.rsqrt(xf.pow(2).sum(-1, keepdim=True) + eps)).to(x.dtype)




class GatedRMSNorm(nn.Module):
    """RMSNorm(x) * weight * act(gate) over the last dim, in float32 (fla's FusedRMSNormGated); act is
    SiLU (GDN's) or sigmoid (Kimi Linear's)."""

    def __init__(self, hidden_size: int, eps: float = 1e-5, activation: str = "silu"):
        super().__init__()
        self.eps = eps
        self.activation = activation
        self.weight = nn.Parameter(torch.ones(hidden_size))

    def forward(self, x: torch.Tensor, gate: torch.Tensor, backend: str = "torch") -> torch.Tensor:
        if _fused_norms(x, backend):
            if self.takes_strided_kernel(x, gate):  # the gate read as the strided slice it is
                return gated_rms_norm_triton(x, gate, self.weight, self.eps, self.activation)
            from fla.modules.norm.fused_norm_gate import rms_norm_gated  # same float32 math, one pass, a backward

            return rms_norm_gated(x, gate, self.weight, None, activation="swish" if self.activation == "silu" else self.activation, eps=self.eps)
        xf = x.float()
        normed = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return (normed * self.weight.float() * GATE_ACTIVATIONS[self.activation](gate.float())).to(x.dtype)

    def takes_strided_kernel(self, x: torch.Tensor, gate: torch.Tensor) -> bool:
        """tcal.gated_norm's kernel (no copy of the gate, no backward): CUDA tensors it takes, no gradient needed."""
        return x.is_cuda and not needs_gradient(self, {"x": x, "gate": gate}) and gated_norm_takes(x, gate, self.weight, self.activation)

    def extra_repr(self) -> str:
        return f"{self.weight.shape[0]}, eps={self.eps}" + ("" if self.activation == "silu" else f", activation={self.activation}")


class CausalConv1d(nn.Conv1d):
    """Depthwise causal convolution on [B, T, C] (fla's ShortConvolution weight layout [C, 1, K]).

    The activation is left to the caller, which knows whether this stream gets SiLU."""

    def __init__(self, channels: int, kernel_size: int, identity_init: bool = True):
        super().__init__(
            channels, channels, kernel_size, groups=channels, padding=kernel_size - 1, bias=False
        )
        if identity_init:
            self.reset_to_identity()

    @torch.no_grad()
    def reset_to_identity(self) -> None:
        """Only the last tap (the current token) is 1, so the convolution passes x through."""
        self.weight.zero_()
        self.weight[:, 0, -1] = 1.0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        seq_len = x.shape[1]
        return super().forward(x.transpose(1, 2))[..., :seq_len].transpose(1, 2)

    def step(self, x: torch.Tensor, past: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """forward() continued from `past`, the last kernel_size-1 inputs [B, K-1, C] (None: zeros,
        which is what the causal padding of forward() means): returns (output, the new past)."""
        keep = self.kernel_size[0] - 1
        if keep == 0:
            return x * self.weight[:, 0, 0], None
        if past is None:
            past = x.new_zeros(x.shape[0], keep, x.shape[2])
        window = torch.cat([past.to(x.dtype), x], dim=1)  # K-1+T inputs: only the state, never the history
        out = F.conv1d(window.transpose(1, 2), self.weight, groups=self.groups).transpose(1, 2)
        return out, window[:, -keep:]


def _fla_decay_init(num_heads: int) -> tuple[torch.Tensor, torch.Tensor]:
    """fla's A_log and dt_bias: A ~ U(0, 16); dt log-uniform in [1e-3, 0.1], floored at 1e-4."""
    a = torch.empty(num_heads, dtype=torch.float32).uniform_(0, 16)
    dt_min, dt_max, dt_floor = 1e-3, 0.1, 1e-4
    log_dt = torch.rand(num_heads) * (math.log(dt_max) - math.log(dt_min)) + math.log(dt_min)
    dt = log_dt.exp().clamp(min=dt_floor)
    return a.log(), dt + torch.log(-torch.expm1(-dt))  # inverse softplus of dt


class GDNCache:
    """What one GatedDeltaNet carries between decoding calls: the recurrent state [B, H, Dk, Dv]
    (float32 from the kernels) and, with short convolutions, the last conv_size-1 inputs of each
    conv stream. Its size is fixed by the batch, not by the length decoded so far, which is the
    point of the layer. With `in_place`, a one-token call writes the new state into the tensor
    that held the old one (tcal.token_step), which a caller replaying a captured step relies on."""

    def __init__(self, in_place: bool = False):
        self.recurrent: torch.Tensor | None = None
        self.conv: dict[str, torch.Tensor] = {}
        self.in_place = in_place  # a decoded token may overwrite `recurrent` instead of replacing it

    def nbytes(self) -> int:
        tensors = [self.recurrent, *self.conv.values()]
        return sum(t.numel() * t.element_size() for t in tensors if t is not None)


# Each parameter's role, named once; align, distill and replace read it through param_groups().
PARAMETER_ROLES = {
    "qkv": ("q_proj", "k_proj", "v_proj"),              # copied from the teacher's attention
    "conv": ("q_conv1d", "k_conv1d", "v_conv1d"),        # new, start as the identity
    "gates": ("a_proj", "b_proj", "g_proj", "A_log", "dt_bias"),  # new, set by Phase 1
    "output": ("o_proj",),                               # copied from the teacher's attention
    "norm": ("o_norm",),                                 # new
}
COPIED_ROLES = ("qkv", "output")


def parameters_by_role(module: nn.Module, roles: dict) -> dict[str, list[tuple[str, nn.Parameter]]]:
    """role -> [(name, parameter)] of `module`, each parameter filed by its top-level name's role."""
    role_of = {root: role for role, roots in roles.items() for root in roots}
    groups: dict[str, list] = {role: [] for role in roles}
    for name, p in module.named_parameters():
        root = name.split(".")[0]
        if root not in role_of:
            raise KeyError(f"{type(module).__name__} parameter {name!r} has no role in PARAMETER_ROLES")
        groups[role_of[root]].append((name, p))
    return groups


def concatenated(weights, biases) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Several linears' weights stacked along the output dim, and their biases (zeros where one
    has none; None where none has one): one matmul then computes them all."""
    weight = torch.cat(list(weights))
    if all(b is None for b in biases):
        return weight, None
    return weight, torch.cat([b if b is not None else w.new_zeros(w.shape[0]) for w, b in zip(weights, biases)])


# On CUDA the fused weight gets zero rows up to a multiple of this many outputs: cuBLAS's fast GEMMs want
# rows of whole 16-byte units, and SmolLM2's GDN projections (2,322 outputs) ran an sm80 cutlass fallback,
# 9.1 of the 75% hybrid's 87 ms at 32k tokens on the H200 (bench/RESULTS.md, sixteenth session).
CUDA_ROW_ALIGN = 64


def row_aligned(weight: torch.Tensor, bias: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """weight [N, K] (and bias [N]) padded with zero rows to a multiple of CUDA_ROW_ALIGN, on CUDA only."""
    pad = -weight.shape[0] % CUDA_ROW_ALIGN
    if not weight.is_cuda or pad == 0:
        return weight, bias
    return F.pad(weight, (0, 0, 0, pad)), (None if bias is None else F.pad(bias, (0, pad)))


def weight_and_bias(layer: nn.Module) -> tuple[torch.Tensor, torch.Tensor | None]:
    """layer.weight and layer.bias, read from its parameter dict where both are registered there: each
    nn.Module attribute read costs about 0.7 us on the CPU, and fused_weight reads 12 every decoded token
    of every layer. A parametrized weight (a property, not in the dict) is read as an attribute."""
    registered = layer._parameters
    if "weight" in registered and "bias" in registered:
        return registered["weight"], registered["bias"]
    return layer.weight, layer.bias


def fused_weight(owner: nn.Module, layers) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The concatenated weight and bias of `layers` (row_aligned). When no gradient is needed (inference, decoding
    one token at a time) the concatenation is kept on `owner` until a parameter changes (tensor
    version counter or storage), so a decode step does not copy every projection matrix again."""
    pairs = [weight_and_bias(l) for l in layers]
    params = [p for pair in pairs for p in pair if p is not None]
    inference = not (torch.is_grad_enabled() and any(p.requires_grad for p in params))
    key = tuple((p.data_ptr(), p._version, p.dtype, p.device) for p in params)
    cached = owner.__dict__.get("_fused_cache")
    if inference and cached is not None and cached[0] == key:
        return cached[1], cached[2]
    weight, bias = row_aligned(*concatenated(*zip(*pairs)))
    if inference:
        owner.__dict__["_fused_cache"] = (key, weight, bias)
    else:
        owner.__dict__.pop("_fused_cache", None)
    return weight, bias


class RecurrentLayer(nn.Module):
    """What every recurrent mixer layer shares (GatedDeltaNet here, tcal.mixers.gla): parameter groups
    by role (a subclass's PARAMETER_ROLES and COPIED_ROLES), its decoding state (a GDNCache: the
    recurrent state and the conv streams' last inputs), its constructor config, and the fused input
    projections (a subclass's INPUT_PROJECTIONS, submodule paths of linears reading the layer input)."""

    TOKEN_STEP = False  # a gated-delta-rule layer (GDN, KDA): a decoded token may take tcal.token_step

    def extra_repr(self) -> str:
        return (f"hidden_size={self.hidden_size}, num_heads={self.num_heads}, head_dim={self.head_dim}, "
                f"use_short_conv={self.use_short_conv}, backend={self.backend}, layer_idx={self.layer_idx}")

    def forward(self, hidden_states: torch.Tensor, cache: GDNCache | None = None, projection=None,
                linear=F.linear) -> torch.Tensor:
        """[B, T, hidden] -> [B, T, hidden]; with a GDNCache, continue the sequence it holds
        (projection: see _input_projections). One decoded token of a TOKEN_STEP layer into an in-place
        cache takes the fused token step (tcal.token_step: one kernel from the projections to the output norm),
        its input and output projections through `linear` (F.linear's arguments: a decoder's few-row kernel)."""
        if cache is not None and takes_token_step(self, hidden_states, cache):
            return token_step_forward(self, hidden_states, cache, projection, linear)
        return self.forward_out(hidden_states, cache, projection)

    def forward_out(self, hidden_states: torch.Tensor, cache: GDNCache | None = None, projection=None) -> torch.Tensor:
        """forward_parts' output alone (a subclass may skip the intermediates it would keep)."""
        return self.forward_parts(hidden_states, cache, projection)["out"]

    def token_decay_input(self, p: dict) -> torch.Tensor:
        """What tcal.token_step reads as the decay's input, from the input projections p: one per head
        [B, 1, H] or one per key channel [B, 1, H * Dk] (a TOKEN_STEP layer defines it)."""
        raise NotImplementedError(f"{type(self).__name__} does not take the fused token step")

    def delta_rule_inputs(self, p: dict, cache: GDNCache | None):
        """q, k (conv, silu, L2-normalised), v, and the write gate's logit and value: what a delta-rule
        layer (GatedDeltaNet, tcal.mixers.kda) feeds its kernel, from the input projections p."""
        q = l2norm(self._stream(p["q_proj"], "q", F.silu, cache), backend=self.backend)
        k = l2norm(self._stream(p["k_proj"], "k", F.silu, cache), backend=self.backend)
        v = self._stream(p["v_proj"], "v", V_ACTIVATIONS[self.v_activation], cache)
        beta_logit = p["b_proj"]
        return q, k, v, beta_logit, beta_logit.float().sigmoid()

    def linear_attention_inputs(self, p: dict, cache: GDNCache | None):
        """q, k (conv then SiLU when the layer has convolutions, else as projected) and v (its
        activation): what a layer without the delta rule (tcal.mixers.gla, mamba2) feeds its kernel."""
        conv_act = F.silu if self.use_short_conv else (lambda x: x)
        q = self._stream(p["q_proj"], "q", conv_act, cache)
        k = self._stream(p["k_proj"], "k", conv_act, cache)
        return q, k, self._stream(p["v_proj"], "v", V_ACTIVATIONS[self.v_activation], cache)

    def gated_output(self, core: torch.Tensor, p: dict, dtype: torch.dtype | None = None) -> dict:
        """The output path every recurrent layer shares: the kernel's output core [B, T, H, Dv] (cast to
        dtype first when given) through o_norm gated by g_proj, then o_proj."""
        gate = self._split_heads(p["g_proj"])
        normed = self.o_norm(core if dtype is None else core.to(dtype), gate, backend=self.backend)
        return dict(core=core, gate=gate, normed=normed, out=self.o_proj(normed.flatten(-2)))

    def param_groups(self) -> dict[str, list[tuple[str, nn.Parameter]]]:
        """role -> [(name, parameter)] in named_parameters order, for every role in PARAMETER_ROLES."""
        return parameters_by_role(self, self.PARAMETER_ROLES)

    def copied_parameters(self) -> list[tuple[str, nn.Parameter]]:
        """The parameters replace fills from the teacher (the rest keep their own init)."""
        groups = self.param_groups()
        return [item for role in self.COPIED_ROLES for item in groups[role]]

    def new_cache(self) -> GDNCache:
        """An empty decoding state for this layer (surgery.decode carries it between calls)."""
        return GDNCache()

    def gdn_config(self) -> dict:
        """Constructor arguments, enough to rebuild this module before loading its state_dict."""
        return dict(self._config, backend=self.backend)

    @classmethod
    def from_gdn_config(cls, config: dict):
        return cls(**config)

    def _common(self, arguments: dict) -> None:
        """The constructor's arguments (gdn_config) and the sizes every recurrent layer keeps."""
        if arguments["v_activation"] not in V_ACTIVATIONS:
            raise ValueError(f"v_activation must be one of {sorted(V_ACTIVATIONS)}, got {arguments['v_activation']!r}")
        self._config = {k: v for k, v in arguments.items() if k not in ("self", "__class__")}
        for name in ("hidden_size", "num_heads", "head_dim", "layer_idx", "use_short_conv", "v_activation", "backend"):
            setattr(self, name, arguments[name])

    def _add_qkv(self, q_bias: bool, k_bias: bool, v_bias: bool) -> None:
        inner = self.num_heads * self.head_dim
        self.q_proj = nn.Linear(self.hidden_size, inner, bias=q_bias)
        self.k_proj = nn.Linear(self.hidden_size, inner, bias=k_bias)
        self.v_proj = nn.Linear(self.hidden_size, inner, bias=v_bias)

    def _add_convs_and_output(self, conv_size: int, conv_identity_init: bool, norm_eps: float, o_bias: bool) -> None:
        """The optional short convolutions, the output gate, its norm and the output projection."""
        inner = self.num_heads * self.head_dim
        if self.use_short_conv:
            self.q_conv1d = CausalConv1d(inner, conv_size, conv_identity_init)
            self.k_conv1d = CausalConv1d(inner, conv_size, conv_identity_init)
            self.v_conv1d = CausalConv1d(inner, conv_size, conv_identity_init)
        self.g_proj = nn.Linear(self.hidden_size, inner, bias=False)
        self.o_norm = GatedRMSNorm(self.head_dim, eps=norm_eps)
        self.o_proj = nn.Linear(inner, self.hidden_size, bias=o_bias)

    def _split_heads(self, x: torch.Tensor) -> torch.Tensor:
        return x.unflatten(-1, (self.num_heads, self.head_dim))

    def _input_projections(self, x: torch.Tensor, projection=None, linear=F.linear) -> dict[str, torch.Tensor]:
        """All INPUT_PROJECTIONS of x as ONE matmul (weights concatenated): at short lengths the layer is
        launch-bound, and one GEMM replaces six (GDN's). `projection` (weight, bias): that concatenation made
        by the caller (a decoder's static step keeps one, since compiling cannot use the cache)."""
        modules = self._modules  # a plain name is a child (get_submodule walks a dotted path, 4x slower a decoded token)
        layers = [modules[n] if n in modules else self.get_submodule(n) for n in self.INPUT_PROJECTIONS]
        if projection is not None:
            weight, bias = projection
        elif torch.compiler.is_compiling():  # the weight cache would break the graph
            return {n: l(x) for n, l in zip(self.INPUT_PROJECTIONS, layers)}
        else:
            weight, bias = fused_weight(self, layers)
        sizes = [l.out_features for l in layers]
        out = linear(x, weight, bias)
        pad = out.shape[-1] - sum(sizes)  # row_aligned's zero rows: split off as one more part, then dropped by zip
        return dict(zip(self.INPUT_PROJECTIONS, out.split_with_sizes(sizes + [pad] if pad else sizes, dim=-1)))

    def _stream(self, y: torch.Tensor, name: str, activation, cache: GDNCache | None = None) -> torch.Tensor:
        """Optional short convolution, activation, split into heads."""
        if self.use_short_conv:
            conv = getattr(self, f"{name}_conv1d")
            if cache is None:
                y = conv(y)
            else:
                y, cache.conv[name] = conv.step(y, cache.conv.get(name))
        return self._split_heads(activation(y))


class GatedDeltaNet(RecurrentLayer):
    """Gated DeltaNet layer: [B, T, hidden] -> [B, T, hidden]. See METHOD.md, 'The student layer'."""

    TOKEN_STEP = True

    def __init__(
        self,
        hidden_size: int,
        num_heads: int,
        head_dim: int,
        *,
        q_bias: bool = False,
        k_bias: bool = False,
        v_bias: bool = False,
        o_bias: bool = False,
        use_short_conv: bool = False,
        conv_size: int = 4,
        conv_identity_init: bool = True,
        norm_eps: float = 1e-5,
        v_activation: str = "silu",
        backend: str = "auto",
        layer_idx: int | None = None,
    ):
        arguments = dict(locals())  # the constructor arguments, in order: gdn_config() rebuilds from them
        super().__init__()
        self._common(arguments)
        self._add_qkv(q_bias, k_bias, v_bias)
        self.a_proj = nn.Linear(hidden_size, num_heads, bias=False)
        self.b_proj = nn.Linear(hidden_size, num_heads, bias=False)
        a_log, dt_bias = _fla_decay_init(num_heads)
        self.A_log = nn.Parameter(a_log)
        self.dt_bias = nn.Parameter(dt_bias)
        self.A_log._no_weight_decay = self.dt_bias._no_weight_decay = True
        self._add_convs_and_output(conv_size, conv_identity_init, norm_eps, o_bias)

    PARAMETER_ROLES = PARAMETER_ROLES
    COPIED_ROLES = COPIED_ROLES

    def extra_repr(self) -> str:
        return (
            f"hidden_size={self.hidden_size}, num_heads={self.num_heads}, head_dim={self.head_dim}, "
            f"use_short_conv={self.use_short_conv}, v_activation={self.v_activation}, "
            f"backend={self.backend}, layer_idx={self.layer_idx}"
        )

    INPUT_PROJECTIONS = ("q_proj", "k_proj", "v_proj", "a_proj", "b_proj", "g_proj")

    def _decay(self, a: torch.Tensor) -> torch.Tensor:
        return -self.A_log.float().exp() * F.softplus(a.float() + self.dt_bias.float())

    def decay(self, x: torch.Tensor) -> torch.Tensor:
        """Log-space decay g = -exp(A_log) * softplus(a_proj x + dt_bias), float32, [B, T, H]."""
        return self._decay(self.a_proj(x))

    @torch.no_grad()
    def set_decay(self, a_log: torch.Tensor, dt_bias: torch.Tensor, proj_scale: float) -> None:
        """Phase 1's decay per head (A_log, dt_bias [H]), a_proj's data-dependent part damped by proj_scale."""
        self.A_log.copy_(a_log)
        self.dt_bias.copy_(dt_bias)
        self.a_proj.weight.mul_(proj_scale)

    def gated_delta_inputs(self, p: dict, cache: GDNCache | None):
        """q, k, v, g, beta for the recurrence from the input projections p: on fla's path without a
        gradient one kernel after the short convolutions (tcal.delta_inputs: the same math, rounded
        once), else the composition (delta_rule_inputs and the decay), which every CPU run keeps."""
        projections = self._projections(p, cache)
        return projections.prepared() if projections is not None else self._composed_inputs(p, cache)

    def _composed_inputs(self, p: dict, cache: GDNCache | None):
        q, k, v, _, beta = self.delta_rule_inputs(p, cache)
        return q, k, v, self._decay(p["a_proj"]), beta

    def _projections(self, p: dict, cache: GDNCache | None) -> Projections | None:
        """The projections (after the short convolutions) as one kernel takes them (takes_fused_inputs), or None."""
        if not takes_fused_inputs(self, p):
            return None
        q, k, v = (self._stream(p[f"{n}_proj"], n, lambda x: x, cache) for n in "qkv")
        return Projections(q, k, v, p["a_proj"], p["b_proj"], self.A_log, self.dt_bias, self.v_activation == "silu")

    def forward_parts(self, hidden_states: torch.Tensor, cache: GDNCache | None = None, projection=None) -> dict[str, torch.Tensor]:
        """Every intermediate of the forward pass, for calibration and diagnostics.

        With a cache, the call continues the sequence the cache has seen (incremental decoding):
        the conv streams start from its last inputs and the recurrence from its state, and both are
        updated in place. gated_delta_rule picks the token loop (or fla's fused recurrent kernel)
        for short calls such as one decoded token, the chunked form for a long prefill."""
        p = self._input_projections(hidden_states, projection)
        q, k, v, g, beta = self.gated_delta_inputs(p, cache)
        core = self._rule(q, k, v, g, beta, cache=cache)
        return dict(q=q, k=k, v=v, g=g, beta=beta, beta_logit=p["b_proj"], **self.gated_output(core, p))

    def forward_out(self, hidden_states: torch.Tensor, cache: GDNCache | None = None, projection=None) -> torch.Tensor:
        """The output alone: the gated output norm handed to the rule (tcal.gated_norm.OutputNorm), which
        applies it inside its last kernel where it can (tcal.chunk_states), the layer's o_norm otherwise."""
        p = self._input_projections(hidden_states, projection)
        gate = self._split_heads(p["g_proj"])
        norm = self.o_norm
        output_norm = OutputNorm(gate, norm.weight, norm.eps, norm.activation, lambda core: norm(core, gate, backend=self.backend))
        projections = self._projections(p, cache)  # the inputs may be formed inside the rule's first kernel (tcal.chunk_inputs)
        inputs = (projections,) if projections is not None else self._composed_inputs(p, cache)
        return self.o_proj(self._rule(*inputs, cache=cache, output_norm=output_norm).flatten(-2))

    def _rule(self, *inputs, cache: GDNCache | None, output_norm: OutputNorm | None = None) -> torch.Tensor:
        """gated_delta_rule's output on (q, k, v, g, beta), or gated_delta_rule_from_projections' on a Projections;
        with a cache, from its state, which it updates."""
        rule = gated_delta_rule_from_projections if len(inputs) == 1 else gated_delta_rule
        state = {} if cache is None else dict(initial_state=cache.recurrent, output_final_state=True)
        core, final = rule(*inputs, scale=self.head_dim**-0.5, backend=self.backend, output_norm=output_norm, **state)
        if cache is not None:
            cache.recurrent = final
        return core

    def token_decay_input(self, p: dict) -> torch.Tensor:
        return p["a_proj"]  # one decay per head


def takes_fused_inputs(layer: GatedDeltaNet, p: dict) -> bool:
    """Whether the recurrence's inputs come from one kernel (tcal.delta_inputs): the layer's fused norms are
    on (fla's path on CUDA, never under torch.compile: _fused_norms), nothing needs a gradient (the
    kernel has no backward), and the kernel takes the projections (a short convolution keeps shapes)."""
    q = p["q_proj"]
    if not _fused_norms(q, layer.backend) or not q.is_cuda or needs_gradient(layer, p):
        return False
    return kernel_takes(*(layer._split_heads(p[f"{n}_proj"]) for n in "qkv"), p["a_proj"], p["b_proj"])


def needs_gradient(layer: nn.Module, p: dict) -> bool:
    """Whether autograd is on and a tensor of p (the projections) or any of the layer's parameters (A_log
    and dt_bias among them, which reach the output only through the decay) asks for a gradient."""
    return torch.is_grad_enabled() and (any(t.requires_grad for t in p.values()) or any(w.requires_grad for w in layer.parameters()))


def takes_token_step(layer: RecurrentLayer, x: torch.Tensor, cache: GDNCache) -> bool:
    """A gated-delta-rule layer (TOKEN_STEP) with the step's SiLU output gate, no short convolution, one
    token, no gradient, a float32 (or float64) state to write in place, and a head the step can hold
    (tcal.token_step.token_step_fits)."""
    s = cache.recurrent
    return (layer.TOKEN_STEP and layer.o_norm.activation == "silu"
            and cache.in_place and s is not None and x.shape[1] == 1 and not layer.use_short_conv
            and not torch.is_grad_enabled() and layer.v_activation in TOKEN_STEP_V_SILU
            and s.dtype in (torch.float32, torch.float64) and s.is_contiguous()
            and tuple(s.shape) == (x.shape[0], layer.num_heads, layer.head_dim, layer.head_dim)
            and token_step_fits(layer.head_dim, s.device.type, layer.backend))


def token_step_forward(layer: RecurrentLayer, x: torch.Tensor, cache: GDNCache, projection=None,
                       linear=F.linear) -> torch.Tensor:
    """A TOKEN_STEP layer's forward of one token through tcal.token_step (the state written in place), the fused
    input projection and o_proj through `linear`."""
    p = layer._input_projections(x, projection, linear)
    normed = gdn_token_step(
        p["q_proj"], p["k_proj"], p["v_proj"], layer.token_decay_input(p), p["b_proj"], p["g_proj"], layer.A_log,
        layer.dt_bias, layer.o_norm.weight, cache.recurrent, layer.head_dim**-0.5, layer.o_norm.eps,
        TOKEN_STEP_V_SILU[layer.v_activation], layer.backend,
    )
    o_proj = layer.o_proj  # a head split's layer has a plain function here (tcal.head_split)
    return linear(normed, o_proj.weight, o_proj.bias) if isinstance(o_proj, nn.Linear) else o_proj(normed)


def constructor_options(annotation: str, cls: type | None = None) -> tuple[str, ...]:
    """GatedDeltaNet's (or `cls`'s) constructor arguments annotated `annotation` ("int", "bool"), in
    order: a recipe's gdn_config is checked against these, so a new option needs no second list."""
    parameters = inspect.signature((cls or GatedDeltaNet).__init__).parameters.values()
    return tuple(p.name for p in parameters if p.annotation == annotation)  # strings: annotations are postponed here
