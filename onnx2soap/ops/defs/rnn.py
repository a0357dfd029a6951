"""LSTM and GRU: ONNX's recurrent layers, forward and backpropagation through time.

What is read: X, W, R, the optional B, initial_h (and initial_c for LSTM), as weights,
constants or activations; ``sequence_lens`` only as a constant whose every entry is the
sequence length (variable lengths would need per-sample masks: refused); directions
forward, reverse and bidirectional; layouts 0 ([seq, batch, ...]) and 1 ([batch, seq,
...]). Refused: other activations than the defaults (Sigmoid/Tanh/Tanh for LSTM,
Sigmoid/Tanh for GRU), ``activation_alpha``/``activation_beta``, ``clip``,
``input_forget=1`` and LSTM peepholes (input P): torch writes none of them. GRU's
``linear_before_reset`` 0 and 1 (torch writes 1) are both supported.

The loop nest, over the dims t (time), d (direction), n (batch) and h (hidden unit):

- **n splits**: each task runs the whole recurrence for its samples, reading its
  directions' weights whole.
- **d splits** for a bidirectional layer: the directions are independent recurrences;
  a task learns which direction it holds from ``TaskArgs.origin`` (its buffers only say
  how many).
- **t never splits**: step t needs the state of step t-1 (t+1 in reverse), so X's time
  axis is read ``Whole(dims=(t,))``: Y keeps the time axis, hidden from splits.
- **h never splits**: every hidden unit of step t reads *all* units of step t-1 through
  R; a split over h would need an all-gather of the state at every time step, which a
  loop nest (one exchange per op) cannot express. W, R and B (and initial_h/c) read
  their hidden axis ``Whole(dims=(h,))``.

With layout 0 the time axis is X's axis 0. Where X is the model's data input itself
(torch's ``batch_first=False``), that is the axis the importer binds as the batch: the op
keeps it (Y's axis 0) but never splits it, and analysis finds no sample dim here. Where a
Transpose put the batch on X's axis 1 (``batch_first=True``), n is the sample dim.

Initial states stored in the model (weights or constants) are bound as constants, never
trained: torch's LSTM and GRU take them as an argument (zeros when omitted) that no
optimizer updates, and its exporters store those zeros as an initializer. Their
gradients are still computed (an activation's flows back to its producer).

Every used output is its own op (Y; Y_h; Y_c), each running the whole recurrence: an
op has one output. The importer prunes the unread ones, so torch's usual export (Y
read, Y_h/Y_c declared) costs one recurrence; a model that reads Y_h as well pays for
two, and the FLOPs count of each op shows it (all have the same points: Y_h's nest
reduces over t).

Kernels are pure, so nothing of the forward survives until the backward: the backward
recomputes the forward's gates from the inputs, then backpropagates through time.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from enum import Enum

from onnx2soap.ir import AxisMap, Binding, Operand, Tensor, TensorRole, Whole, identity
from onnx2soap.ops.base import NONE, SAVES_INPUTS, C, OpDef, W, X, case
from onnx2soap.ops.context import NodeContext, make_op, text


class Cell(Enum):
    LSTM = "LSTM"
    GRU = "GRU"

    @property
    def gates(self) -> int:
        return 4 if self is Cell.LSTM else 3

    @property
    def activations(self) -> tuple[str, ...]:
        """The spec's defaults, the only ones supported (per direction)."""
        return ("Sigmoid", "Tanh", "Tanh") if self is Cell.LSTM else ("Sigmoid", "Tanh")

    @property
    def elementwise_flops(self) -> int:
        """Per hidden unit and step, besides the matrix products: ~4 per sigmoid/tanh
        plus the state updates (an estimate for the cost model)."""
        return 24 if self is Cell.LSTM else 18


class Output(Enum):
    Y = 0  # every step's hidden state
    Y_H = 1  # the last hidden state
    Y_C = 2  # the last cell state (LSTM)


_DIRECTIONS = {"forward": (False,), "reverse": (True,), "bidirectional": (False, True)}


@dataclass(frozen=True)
class RnnAttrs:
    cell: Cell
    hidden: int
    reverse: tuple[bool, ...]  # per direction of the whole op: runs backwards in time
    batch_first: bool  # layout=1
    output: Output
    has_bias: bool
    has_h0: bool
    has_c0: bool
    linear_before_reset: bool = False  # GRU

    @property
    def direction_axis(self) -> int:
        """The output axis of the direction dim."""
        if self.output is Output.Y:
            return 2 if self.batch_first else 1
        return 1 if self.batch_first else 0


# --- converter ---------------------------------------------------------------------------


def _shape_error(ctx: NodeContext, what: str, t: Tensor, want: tuple[int, ...]):
    return ctx.fail(f"{what} '{t.name}' is {list(t.shape)}; expected {list(want)}")


def _check_attributes(
    ctx, cell: Cell, dirs: int, activations, activation_alpha, activation_beta, clip
):
    if clip is not None:
        raise ctx.fail(f"clip={clip} is not supported; only unclipped cells (no clip attribute)")
    if activation_alpha or activation_beta:
        raise ctx.fail(
            "activation_alpha/activation_beta are not supported; only the default activations"
        )
    if activations is not None:
        names = [text(a) for a in activations]
        if names != list(cell.activations) * dirs:
            raise ctx.fail(
                f"activations {names} are not supported; only the defaults "
                f"{list(cell.activations)}, once per direction ({dirs})"
            )


def _sequence_lens(ctx: NodeContext, seq: int, batch: int) -> None:
    """Refuse sequence_lens unless every sequence is whole (then it changes nothing)."""
    given = len(ctx.inputs) > 4 and (ctx.inputs[4] is not None or ctx.is_constant(4))
    if not given:
        return
    if not ctx.is_constant(4):
        raise ctx.fail(
            "sequence_lens computed at run time is not supported; only a constant whose "
            "entries all equal the sequence length"
        )
    lens = ctx.constant(4)
    if lens.shape != (batch,) or (lens != seq).any():
        raise ctx.fail(
            f"sequence_lens {lens.reshape(-1).tolist()[:8]} (shape {list(lens.shape)}): only "
            f"[{batch}] entries all equal to the sequence length {seq} are supported "
            "(variable lengths are not)"
        )


def _convert(
    ctx: NodeContext,
    cell: Cell,
    *,
    activation_alpha,
    activation_beta,
    activations,
    clip,
    direction,
    hidden_size,
    layout,
    linear_before_reset=0,
    input_forget=0,
):
    direction = text(direction)
    if direction not in _DIRECTIONS:
        raise ctx.fail(f"direction {direction!r} is invalid; accepted: {sorted(_DIRECTIONS)}")
    dirs = len(_DIRECTIONS[direction])
    _check_attributes(ctx, cell, dirs, activations, activation_alpha, activation_beta, clip)
    if layout not in (0, 1):
        raise ctx.fail(f"layout={layout} is invalid; accepted: 0 or 1")
    if input_forget:
        raise ctx.fail("input_forget=1 (coupled input and forget gates) is not supported")
    if linear_before_reset not in (0, 1):
        raise ctx.fail(f"linear_before_reset={linear_before_reset} is invalid; 0 or 1")
    peephole = cell is Cell.LSTM and len(ctx.inputs) > 7
    if peephole and (ctx.inputs[7] is not None or ctx.is_constant(7)):
        raise ctx.fail("peephole weights (input P) are not supported")

    x, w, r = ctx.tensor(0), ctx.tensor(1), ctx.tensor(2)
    if len(x.shape) != 3:
        raise ctx.fail(f"X '{x.name}' is {list(x.shape)}; expected rank 3")
    batch_first = bool(layout)
    seq, batch = (x.shape[1], x.shape[0]) if batch_first else (x.shape[0], x.shape[1])
    size = x.shape[2]
    if seq < 1:
        raise ctx.fail("the sequence is empty")
    hidden = r.shape[-1] if hidden_size is None and len(r.shape) == 3 else hidden_size
    if hidden is None or hidden < 1:
        raise ctx.fail(f"hidden_size={hidden_size} must be a positive integer")
    g = cell.gates
    if w.shape != (dirs, g * hidden, size):
        raise _shape_error(ctx, "W", w, (dirs, g * hidden, size))
    if r.shape != (dirs, g * hidden, hidden):
        raise _shape_error(ctx, "R", r, (dirs, g * hidden, hidden))
    b = ctx.optional(3)
    if b is not None and b.shape != (dirs, 2 * g * hidden):
        raise _shape_error(ctx, "B", b, (dirs, 2 * g * hidden))
    _sequence_lens(ctx, seq, batch)
    state_shape = (batch, dirs, hidden) if batch_first else (dirs, batch, hidden)
    states = [ctx.optional(5)] + ([ctx.optional(6)] if cell is Cell.LSTM else [])
    for name, s in zip(("initial_h", "initial_c"), states, strict=False):
        if s is not None and s.shape != state_shape:
            raise _shape_error(ctx, name, s, state_shape)

    base = RnnAttrs(
        cell=cell,
        hidden=hidden,
        reverse=_DIRECTIONS[direction],
        batch_first=batch_first,
        output=Output.Y,
        has_bias=b is not None,
        has_h0=states[0] is not None,
        has_c0=len(states) > 1 and states[1] is not None,
        linear_before_reset=bool(linear_before_reset),
    )
    sizes = {"t": seq, "d": dirs, "n": batch, "h": hidden}
    # Per (t, d, n, h): the gates' products with [x_t, h_{t-1}], their biases, the rest.
    flops = 2 * g * (size + hidden) + 2 * g + cell.elementwise_flops
    ops = []
    for out in Output:
        if out.value >= len(ctx.outputs) or not ctx.outputs[out.value]:
            continue  # omitted, or (GRU) no such output
        attrs = replace(base, output=out)
        names = _dim_order(out, batch_first)
        dim = {n: i for i, n in enumerate(names)}
        operands = _operands(dim, batch_first, x, w, r, b, states)
        out_dims = range(4 if out is Output.Y else 3)
        dims = [(n, sizes[n]) for n in names]
        name = ctx.name if out is Output.Y else f"{ctx.name}:{out.name}"
        output = ctx.outputs[out.value]
        ops.append(make_op(ctx, operands, attrs, dims, out_dims, flops, output=output, name=name))
    return tuple(ops)


def _dim_order(out: Output, batch_first: bool) -> tuple[str, ...]:
    """The dims in the order of the output's axes; for Y_h/Y_c, t (reduced) last."""
    if out is Output.Y:
        return ("n", "t", "d", "h") if batch_first else ("t", "d", "n", "h")
    return ("n", "d", "h", "t") if batch_first else ("d", "n", "h", "t")


def _operands(dim, batch_first, x, w, r, b, states) -> list[Operand]:
    t, d, n, h = dim["t"], dim["d"], dim["n"], dim["h"]
    time = Whole(dims=(t,))  # sequential: never split
    units = Whole(dims=(h,))  # mixed through R at every step: never split
    x_axes: tuple[AxisMap, ...] = (
        (identity(n), time, Whole()) if batch_first else (time, identity(n), Whole())
    )
    weight = (identity(d), units, Whole())
    operands = [Operand(x.name, x_axes), Operand(w.name, weight), Operand(r.name, weight)]
    if b is not None:
        operands.append(Operand(b.name, (identity(d), units)))
    state = (identity(n), identity(d), units) if batch_first else (identity(d), identity(n), units)
    operands += [Operand(s.name, state, binding=_state_binding(s)) for s in states if s is not None]
    return operands


def _state_binding(s: Tensor) -> Binding:
    """An initial state stored in the model is read, never trained: torch's LSTM and GRU
    take it as an argument (zeros when omitted) that no optimizer updates, and its
    exporters store those zeros as an initializer (dynamo passes one for both h and c)."""
    stored = s.role in (TensorRole.WEIGHT, TensorRole.CONSTANT)
    return Binding.CONSTANT if stored else Binding.READ


def convert_lstm(
    ctx: NodeContext,
    *,
    activation_alpha=None,
    activation_beta=None,
    activations=None,
    clip=None,
    direction="forward",
    hidden_size=None,
    input_forget=0,
    layout=0,
):
    return _convert(
        ctx,
        Cell.LSTM,
        activation_alpha=activation_alpha,
        activation_beta=activation_beta,
        activations=activations,
        clip=clip,
        direction=direction,
        hidden_size=hidden_size,
        layout=layout,
        input_forget=input_forget,
    )


def convert_gru(
    ctx: NodeContext,
    *,
    activation_alpha=None,
    activation_beta=None,
    activations=None,
    clip=None,
    direction="forward",
    hidden_size=None,
    layout=0,
    linear_before_reset=0,
):
    return _convert(
        ctx,
        Cell.GRU,
        activation_alpha=activation_alpha,
        activation_beta=activation_beta,
        activations=activations,
        clip=clip,
        direction=direction,
        hidden_size=hidden_size,
        layout=layout,
        linear_before_reset=linear_before_reset,
    )


# --- kernels: shared plumbing --------------------------------------------------------------


@dataclass(frozen=True)
class _Buffers:
    """A task's buffers in time-major layout: x [T, N, I]; per local direction w [G*H, I],
    r [G*H, H], wb and rb [G*H], h0 and c0 [N, H]."""

    x: object
    w: object
    r: object
    wb: object
    rb: object
    h0: object
    c0: object


def _unpack(xp, attrs: RnnAttrs, inputs) -> _Buffers:
    x, w, r = inputs[0], inputs[1], inputs[2]
    rest = list(inputs[3:])
    b = rest.pop(0) if attrs.has_bias else None
    h0 = rest.pop(0) if attrs.has_h0 else None
    c0 = rest.pop(0) if attrs.has_c0 else None
    if attrs.batch_first:
        x = xp.transpose(x, (1, 0, 2))
        h0 = None if h0 is None else xp.transpose(h0, (1, 0, 2))
        c0 = None if c0 is None else xp.transpose(c0, (1, 0, 2))
    dirs, gh = w.shape[0], w.shape[1]
    zeros_state = xp.zeros((dirs, x.shape[1], attrs.hidden), dtype=x.dtype)
    if b is None:
        b = xp.zeros((dirs, 2 * gh), dtype=x.dtype)
    return _Buffers(
        x,
        w,
        r,
        b[:, :gh],
        b[:, gh:],
        zeros_state if h0 is None else h0,
        zeros_state if c0 is None else c0,
    )


def _reverse_flags(attrs: RnnAttrs, args, local_dirs: int) -> tuple[bool, ...]:
    """Per local direction, whether it runs backwards: the buffers hold directions
    ``origin[direction axis]`` on (a split over d gives each task some of them)."""
    if local_dirs == len(attrs.reverse):
        return attrs.reverse
    if not args.origin:
        raise ValueError("RNN: a split over the directions needs TaskArgs.origin")
    first = args.origin[attrs.direction_axis]
    return attrs.reverse[first : first + local_dirs]


def _sigmoid(xp, v):
    return 0.5 * (xp.tanh(0.5 * v) + 1)  # no overflow for large |v|, unlike 1/(1+exp(-v))


def _in_order(xp, a, reverse: bool):
    """A time-major array in the order the direction processes it."""
    return a[::-1].copy() if reverse else a


@dataclass
class _Trace:
    """One direction's forward, in processing order: hs/cs [T+1, N, H] (the initial state
    first), the per-step activations ``acts`` and, for GRU, the reset-gated term ``gated``."""

    hs: object
    cs: object
    acts: object
    gated: object


def _lstm_forward(xp, x, w, r, wb, rb, h, c) -> _Trace:
    hidden = r.shape[1]
    xw = xp.matmul(x, w.T) + (wb + rb)  # [T, N, 4H], gates i, o, f, c
    hs, cs, acts = [h], [c], []
    for s in range(x.shape[0]):
        g = xw[s] + xp.matmul(h, r.T)
        i = _sigmoid(xp, g[:, :hidden])
        o = _sigmoid(xp, g[:, hidden : 2 * hidden])
        f = _sigmoid(xp, g[:, 2 * hidden : 3 * hidden])
        u = xp.tanh(g[:, 3 * hidden :])
        c = f * c + i * u
        h = o * xp.tanh(c)
        hs.append(h)
        cs.append(c)
        acts.append(xp.concatenate([i, o, f, u], axis=1))
    return _Trace(xp.stack(hs), xp.stack(cs), xp.stack(acts), None)


def _lstm_backward(xp, x, w, r, trace: _Trace, dys, dh, dc):
    """Gradients (x, w, r, wb, rb, h0, c0) of one direction, in processing order."""
    hidden = r.shape[1]
    dgates = [None] * x.shape[0]
    for s in reversed(range(x.shape[0])):
        a = trace.acts[s]
        i, o = a[:, :hidden], a[:, hidden : 2 * hidden]
        f, u = a[:, 2 * hidden : 3 * hidden], a[:, 3 * hidden :]
        dh = dh + dys[s]
        tc = xp.tanh(trace.cs[s + 1])
        dc = dc + dh * o * (1 - tc * tc)
        dg = xp.concatenate(
            [
                dc * u * i * (1 - i),
                dh * tc * o * (1 - o),
                dc * trace.cs[s] * f * (1 - f),
                dc * i * (1 - u * u),
            ],
            axis=1,
        )
        dgates[s] = dg
        dh = xp.matmul(dg, r)
        dc = dc * f
    dg = xp.stack(dgates)  # [T, N, 4H]: the gradient of every gate's pre-activation
    return _weight_grads(xp, x, w, dg, dg, trace.hs[:-1], dh, dc)


def _weight_grads(xp, x, w, dxw, drh, hprev, dh0, dc0):
    """From the pre-activation gradients of the input part ``dxw`` and of the recurrent
    part ``drh`` (their multiplicands: x and ``hprev``), every gradient."""
    flat = x.shape[0] * x.shape[1]
    dxw2 = dxw.reshape(flat, dxw.shape[2])
    drh2 = drh.reshape(flat, drh.shape[2])
    dx = xp.matmul(dxw, w)
    dw = xp.matmul(dxw2.T, x.reshape(flat, x.shape[2]))
    dr = xp.matmul(drh2.T, hprev.reshape(flat, hprev.shape[2]))
    return dx, dw, dr, dxw2.sum(axis=0), drh2.sum(axis=0), dh0, dc0


def _gru_forward(xp, x, w, r, wb, rb, h, linear_before_reset: bool) -> _Trace:
    hidden = r.shape[1]
    xw = xp.matmul(x, w.T) + wb  # [T, N, 3H], gates z, r, h
    r_zr, r_h = r[: 2 * hidden], r[2 * hidden :]
    hs, acts, gated = [h], [], []
    for s in range(x.shape[0]):
        zr = xw[s, :, : 2 * hidden] + xp.matmul(h, r_zr.T) + rb[: 2 * hidden]
        z = _sigmoid(xp, zr[:, :hidden])
        reset = _sigmoid(xp, zr[:, hidden:])
        if linear_before_reset:
            term = xp.matmul(h, r_h.T) + rb[2 * hidden :]  # reset applied after R
            a = xw[s, :, 2 * hidden :] + reset * term
        else:
            term = reset * h  # reset applied before R
            a = xw[s, :, 2 * hidden :] + xp.matmul(term, r_h.T) + rb[2 * hidden :]
        n = xp.tanh(a)
        h = (1 - z) * n + z * h
        hs.append(h)
        acts.append(xp.concatenate([z, reset, n], axis=1))
        gated.append(term)
    return _Trace(xp.stack(hs), None, xp.stack(acts), xp.stack(gated))


def _gru_backward(xp, x, w, r, trace: _Trace, dys, dh, linear_before_reset: bool):
    hidden = r.shape[1]
    r_zr, r_h = r[: 2 * hidden], r[2 * hidden :]
    dxws, drhs = [None] * x.shape[0], [None] * x.shape[0]
    for s in reversed(range(x.shape[0])):
        a = trace.acts[s]
        z, reset, n = a[:, :hidden], a[:, hidden : 2 * hidden], a[:, 2 * hidden :]
        hp, term = trace.hs[s], trace.gated[s]
        dh = dh + dys[s]
        da = dh * (1 - z) * (1 - n * n)  # d pre-activation of the candidate
        dz = dh * (hp - n) * z * (1 - z)
        dhp = dh * z
        if linear_before_reset:
            dterm = da * reset  # d (h R_h^T + Rb_h)
            dreset = da * term
            dhp = dhp + xp.matmul(dterm, r_h)
        else:
            dterm = da  # d of (reset * h) R_h^T: R_h's own gradient pairs da with term
            dgated = xp.matmul(da, r_h)
            dreset = dgated * hp
            dhp = dhp + dgated * reset
        dr = dreset * reset * (1 - reset)
        dzr = xp.concatenate([dz, dr], axis=1)
        dhp = dhp + xp.matmul(dzr, r_zr)
        dxws[s] = xp.concatenate([dz, dr, da], axis=1)
        drhs[s] = (dzr, dterm)
        dh = dhp
    dxw = xp.stack(dxws)
    dzr = xp.stack([d for d, _ in drhs])  # [T, N, 2H], multiplies h_{t-1}
    dterm = xp.stack([d for _, d in drhs])  # [T, N, H], multiplies hp or reset * hp
    hprev = trace.hs[:-1]
    h_mult = hprev if linear_before_reset else trace.gated
    dx, dw, dr_zr, dwb, drb_zr, _, _ = _weight_grads(xp, x, w, dxw, dzr, hprev, dh, None)
    flat = x.shape[0] * x.shape[1]
    dterm2 = dterm.reshape(flat, hidden)
    dr_h = xp.matmul(dterm2.T, h_mult.reshape(flat, hidden))
    dr_all = xp.concatenate([dr_zr, dr_h], axis=0)
    drb = xp.concatenate([drb_zr, dterm2.sum(axis=0)])
    return dx, dw, dr_all, dwb, drb, dh, None


def _run(xp, attrs: RnnAttrs, buf: _Buffers, k: int, reverse: bool) -> _Trace:
    x = _in_order(xp, buf.x, reverse)
    if attrs.cell is Cell.LSTM:
        return _lstm_forward(xp, x, buf.w[k], buf.r[k], buf.wb[k], buf.rb[k], buf.h0[k], buf.c0[k])
    return _gru_forward(
        xp, x, buf.w[k], buf.r[k], buf.wb[k], buf.rb[k], buf.h0[k], attrs.linear_before_reset
    )


# --- kernels -----------------------------------------------------------------------------


def forward(xp, attrs: RnnAttrs, inputs, args):
    buf = _unpack(xp, attrs, inputs)
    flags = _reverse_flags(attrs, args, buf.w.shape[0])
    parts = []
    for k, reverse in enumerate(flags):
        trace = _run(xp, attrs, buf, k, reverse)
        if attrs.output is Output.Y:
            parts.append(_in_order(xp, trace.hs[1:], reverse))  # back to time order
        else:
            parts.append((trace.hs if attrs.output is Output.Y_H else trace.cs)[-1])
    if attrs.output is Output.Y:
        y = xp.stack(parts, axis=1)  # [T, D, N, H]
        return xp.transpose(y, (2, 0, 1, 3)).copy() if attrs.batch_first else y
    y = xp.stack(parts)  # [D, N, H]
    return xp.transpose(y, (1, 0, 2)).copy() if attrs.batch_first else y


def _output_grads(xp, attrs: RnnAttrs, grad_output, k: int, shape):
    """Direction k's (dY [T, N, H], d last h, d last c) from the output's gradient."""
    t, n, h = shape
    zeros_seq = xp.zeros((t, n, h), dtype=grad_output.dtype)
    zeros = xp.zeros((n, h), dtype=grad_output.dtype)
    if attrs.output is Output.Y:
        g = xp.transpose(grad_output, (1, 2, 0, 3)) if attrs.batch_first else grad_output
        return g[:, k], zeros, zeros
    g = grad_output[:, k] if attrs.batch_first else grad_output[k]
    return (zeros_seq, g, zeros) if attrs.output is Output.Y_H else (zeros_seq, zeros, g)


def backward(xp, attrs: RnnAttrs, inputs, output, grad_output, args):
    buf = _unpack(xp, attrs, inputs)
    flags = _reverse_flags(attrs, args, buf.w.shape[0])
    shape = (buf.x.shape[0], buf.x.shape[1], attrs.hidden)
    dx = xp.zeros_like(buf.x)
    dw, dr, db, dh0, dc0 = [], [], [], [], []
    for k, reverse in enumerate(flags):
        trace = _run(xp, attrs, buf, k, reverse)
        dys, dh, dc = _output_grads(xp, attrs, grad_output, k, shape)
        x = _in_order(xp, buf.x, reverse)
        dys = _in_order(xp, dys, reverse)
        if attrs.cell is Cell.LSTM:
            grads = _lstm_backward(xp, x, buf.w[k], buf.r[k], trace, dys, dh, dc)
        else:
            grads = _gru_backward(
                xp, x, buf.w[k], buf.r[k], trace, dys, dh, attrs.linear_before_reset
            )
        gx, gw, gr, gwb, grb, gh, gc = grads
        dx = dx + _in_order(xp, gx, reverse)
        dw.append(gw)
        dr.append(gr)
        db.append(xp.concatenate([gwb, grb]))
        dh0.append(gh)
        dc0.append(gc)
    result = [dx, xp.stack(dw), xp.stack(dr)]
    if attrs.has_bias:
        result.append(xp.stack(db))
    states = [(attrs.has_h0, dh0), (attrs.has_c0, dc0)]
    result += [xp.stack(g) for present, g in states if present]
    if attrs.batch_first:  # back to [batch, seq, ...] and [batch, directions, hidden]
        first_state = 3 + attrs.has_bias
        result = [
            xp.transpose(g, (1, 0, 2)).copy() if i == 0 or i >= first_state else g
            for i, g in enumerate(result)
        ]
    return tuple(r.astype(i.dtype, copy=False) for r, i in zip(result, inputs, strict=True))


def workspace(attrs: RnnAttrs, shapes, out_shape, itemsize: int) -> tuple[int, int]:
    """The most the kernels above hold at once besides X, the weights, Y and the gradients
    they return (in bytes), counted from what they allocate, in units of one step's state
    ``e`` (N x H) and of the whole sequence's ``seq`` (T x N x H).

    A direction's recurrence (``_run``) holds the input products ``xw`` (G x seq), the
    per-step states and gate activations in lists *and* their stacked copies (LSTM: h, c
    and the G gates; GRU: h, the gates and the reset-gated term), and its last step's
    locals. The backward runs that recurrence again, then keeps its trace while it builds
    the pre-activation gradients, again as a list and a stack, with dX's products and the
    weights' gradients (GRU: R's in two parts and concatenated). A direction's trace lives
    on while the next one runs (the variable holding it is reassigned after the run), its
    weights' gradients to the end; a reversed direction copies X (once in the forward,
    twice in the backward)."""
    x, w = shapes[0], shapes[1]
    steps, batch = (x[1], x[0]) if attrs.batch_first else (x[0], x[1])
    dirs, gates = w[0], attrs.cell.gates
    e = batch * attrs.hidden * itemsize
    seq = steps * e
    xs = math.prod(x) * itemsize
    lstm = attrs.cell is Cell.LSTM
    run = (3 * gates + 4) * seq + (2 * gates + 2 if lstm else 7) * e
    trace = (gates + 2) * seq + 2 * e  # the stacked states and activations
    flipped = xs if any(attrs.reverse) else 0  # X copied into processing order
    zeros = dirs * e  # the zero initial state _unpack makes
    forward_ = zeros + (dirs - 1) * trace + flipped + run
    grads = sum(math.prod(s) for s in shapes) * itemsize
    weights = (grads - xs) // dirs  # one direction's gradients of W, R, B and the states
    lists = 2 * gates * seq if lstm else 2 * (gates + 3) * seq  # and their stacks
    unread = seq if attrs.output is not Output.Y else 0  # dY of an output without time
    bptt = trace + lists + 2 * xs + (1 if lstm else 2) * weights + unread
    earlier = (dirs - 1) * weights  # the previous directions' gradients, in lists
    backward_ = zeros + xs + 2 * flipped + earlier + max((dirs - 1) * trace + run, bptt)
    return forward_, max(backward_ - grads, 0)


# --- definitions -------------------------------------------------------------------------

# Sizes: seq 3, batch 2-3, input 3-4, hidden 2-3 (finite differences run the whole
# recurrence twice per sampled element). onnxruntime refuses layout=1 ("Batchwise
# recurrent operations (layout == 1) are not supported"), so no case uses it.
LSTM = OpDef(
    name="LSTM",
    versions=(7, 14, 22),
    convert=convert_lstm,
    forward=forward,
    backward=backward,
    workspace=workspace,
    saves=SAVES_INPUTS,  # the recurrence is run again from the inputs: Y is not read
    cases=(
        case("lstm", "LSTM", X(3, 2, 4), W(1, 12, 4), W(1, 12, 3), hidden_size=3),
        case(
            "lstm_bias_initial_states",
            "LSTM",
            X(3, 2, 4),
            W(1, 12, 4),
            W(1, 12, 3),
            W(1, 24),
            NONE,
            W(1, 2, 3),
            W(1, 2, 3),
            hidden_size=3,
        ),
        case(
            "lstm_bidirectional",
            "LSTM",
            X(3, 2, 3),
            W(2, 8, 3),
            W(2, 8, 2),
            W(2, 16),
            hidden_size=2,
            direction="bidirectional",
        ),
        case(
            "lstm_reverse",
            "LSTM",
            X(3, 3, 3),
            W(1, 8, 3),
            W(1, 8, 2),
            W(1, 16),
            NONE,
            NONE,
            W(1, 3, 2),
            hidden_size=2,
            direction="reverse",
        ),
        # torch's legacy exporter declares Y_h and Y_c even when only Y is read.
        case(
            "lstm_unread_states_sequence_lens",
            "LSTM",
            X(3, 2, 3),
            W(1, 8, 3),
            W(1, 8, 2),
            W(1, 16),
            C([3, 3], dtype="int32"),
            extra_outputs=2,
            hidden_size=2,
        ),
        case(
            "lstm_opset13_default_activations",
            "LSTM",
            X(3, 2, 3),
            W(1, 8, 3),
            W(1, 8, 2),
            opset=13,
            hidden_size=2,
            activations=["Sigmoid", "Tanh", "Tanh"],
        ),
    ),
)

GRU = OpDef(
    name="GRU",
    versions=(7, 14, 22),
    convert=convert_gru,
    forward=forward,
    backward=backward,
    workspace=workspace,
    saves=SAVES_INPUTS,  # the recurrence is run again from the inputs: Y is not read
    cases=(
        case("gru", "GRU", X(3, 2, 4), W(1, 9, 4), W(1, 9, 3), W(1, 18), hidden_size=3),
        case(
            "gru_linear_before_reset",
            "GRU",
            X(3, 2, 4),
            W(1, 9, 4),
            W(1, 9, 3),
            W(1, 18),
            NONE,
            W(1, 2, 3),
            hidden_size=3,
            linear_before_reset=1,
        ),
        case(
            "gru_bidirectional",
            "GRU",
            X(3, 2, 3),
            W(2, 6, 3),
            W(2, 6, 2),
            W(2, 12),
            NONE,
            W(2, 2, 2),
            hidden_size=2,
            direction="bidirectional",
            linear_before_reset=1,
            activations=["Sigmoid", "Tanh", "Sigmoid", "Tanh"],
        ),
        case(
            "gru_reverse_initial_constant",
            "GRU",
            X(3, 3, 3),
            W(1, 6, 3),
            W(1, 6, 2),
            NONE,
            NONE,
            C([0.5, -0.25, 0.1, 0.7, -0.3, 0.2], dtype="float32", shape=(1, 3, 2)),
            hidden_size=2,
            direction="reverse",
        ),
        case(
            "gru_opset22_unread_state",
            "GRU",
            X(3, 2, 3),
            W(1, 6, 3),
            W(1, 6, 2),
            W(1, 12),
            opset=22,
            extra_outputs=1,
            hidden_size=2,
            linear_before_reset=1,
        ),
    ),
)

DEFINITIONS = (LSTM, GRU)
