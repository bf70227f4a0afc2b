"""Checkers for drills 1 to 4 of the exercise notebook: the drills that train.

Drill 1 trains the MLP to the target, drill 2 times ``torch.compile`` on
training steps, drill 3 trains with SGD against drill 1's AdamW, and drill 4
accumulates gradients. Their checkers trust no count or size an answer reports:
drill 1's epochs are counted from the shuffles its generator drew, and its steps
read from the optimizer's own state; drill 4's checker takes the compared steps
itself, the big-batch way, and holds the answer's gradients and weights to its
own.

It builds on ``torchbook.book.lab``: its count of the epochs a generator
shuffled (``epochs_shuffled``) and drill 4's compared steps
(``compared_steps``).
"""

from __future__ import annotations

import copy
import math
from collections.abc import Mapping, Sequence

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.nn.utils import get_total_norm

from torchbook.book.drills import fail_if, same_tensors, test_accuracy
from torchbook.book.lab import COMPARED_LR, compared_steps, epochs_shuffled

TARGET_ACCURACY = 0.97
MAX_EPOCHS = 3
TRAIN_EXAMPLES = 60_000  # MNIST's training split: one shuffle of it per epoch
MAX_EPOCHS_REPLAYED = 10  # drill 1 replays at most this many shuffles
# Drill 1's zero_grad hint: without zero_grad, .grad holds the sum of every step's
# gradient. Against one fresh batch's gradient it was 28 to 70 times as large after
# 100 such steps, at most 3 times after 1,407 correct ones (seeds 0-2).
ZERO_GRAD_HINT_RATIO = 10
# drill 2: fused kernels sum float32 products in another order
COMPILED_LOGIT_ATOL = 1e-4
# Drill 4, against the checker's own big-batch steps. The first gradients are the
# same sums in another order: equal to float32 rounding (about 1e-7 of their norm).
# After the steps, AdamW's division by each gradient's running size plus eps turns
# the rounding of a gradient about eps in size into a step of up to the learning
# rate: after 20 correct steps at most 5 of 235,146 weights were more than 1e-6 off
# (seeds 0-9 and 1337, two CPUs); a missing zero_grad moves almost all. Later the
# differences grow like any perturbation (9% of the weights after 50 steps).
ACCUMULATION_BATCH_SIZE = 128
COMPARED_STEPS = 20
GRADIENT_RTOL = 1e-5
ACCUMULATION_WEIGHT_ATOL = 1e-6
MAX_FRACTION_BEYOND_ATOL = 1e-3
MAX_ACCURACY_GAP = 0.005  # drill 4: "unchanged" accuracy, half a percentage point


def _gradient_left_ratio(model: nn.Module, images: Tensor, labels: Tensor) -> float:
    """The norm of the gradients left in ``.grad``, over one fresh batch's."""
    left = [p.grad for p in model.parameters() if p.grad is not None]
    batch = slice(0, ACCUMULATION_BATCH_SIZE)  # one batch of the drills' size
    loss = F.cross_entropy(model(images[batch]), labels[batch])
    fresh = torch.autograd.grad(loss, list(model.parameters()))  # .grad untouched
    return (get_total_norm(left) / get_total_norm(fresh)).item() if left else 0.0


def check_drill_1(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    initial_state: Mapping[str, Tensor],
    train_order: torch.Generator,
    batch_size: int,
    test_images: Tensor,
    test_labels: Tensor,
) -> str:
    """At most 3 epochs, every parameter moved, test accuracy >= 97%.

    The epochs are counted from the shuffles ``train_order`` drew, the steps
    from the optimizer's own state: no reported count is trusted. The epochs
    bound the steps: a run that shuffled some of its epochs with another
    generator took more steps than ``train_order``'s epochs hold, even at the
    ``batch_size`` it reports.
    """
    problems = []
    epochs = epochs_shuffled(train_order, TRAIN_EXAMPLES, MAX_EPOCHS_REPLAYED)
    if epochs is None:
        problems.append(
            f"train_order drew more than {MAX_EPOCHS_REPLAYED} shuffles of the "
            f"{TRAIN_EXAMPLES:,} training images, or other random numbers, since it "
            "was seeded: draw each epoch's batches with resident_batches(train_images, "
            "train_labels, batch_size, train_order), from one generator seeded once"
        )
    elif epochs > MAX_EPOCHS:
        problems.append(
            f"train_order shuffled the training set {epochs} times: {epochs} epochs, "
            f"and the drill allows {MAX_EPOCHS}"
        )
    counts = [
        int(state["step"]) for state in optimizer.state.values() if "step" in state
    ]
    steps = max(counts, default=0)
    most_steps = (epochs or 0) * math.ceil(TRAIN_EXAMPLES / batch_size)
    if not counts:
        problems.append(
            f"{type(optimizer).__name__} has taken no step, or keeps no step count "
            "(the drill uses torch.optim.AdamW)"
        )
    elif epochs is not None and steps > most_steps:
        if epochs == 0:
            drawn = (
                "train_order was never drawn from (it is as it was seeded), but the "
                f"optimizer took {steps:,} steps: their batches came from another "
                "generator"
            )
        else:
            drawn = (
                f"train_order shuffled {epochs} epoch{'s' if epochs > 1 else ''}: at "
                f"most {most_steps:,} steps of batches of {batch_size}, but the "
                f"optimizer took {steps:,}: the steps beyond them drew their batches "
                "from another generator"
            )
        problems.append(
            f"{drawn}; make train_order once, before the first epoch, and give it to "
            "every resident_batches call"
        )
    current = model.state_dict()
    live = {tensor.untyped_storage().data_ptr() for tensor in current.values()}
    frozen = [
        name
        for name, tensor in initial_state.items()
        if name in current and torch.equal(current[name].cpu(), tensor.cpu())
    ]
    if any(t.untyped_storage().data_ptr() in live for t in initial_state.values()):
        problems.append(
            "initial_state holds the model's own tensors: state_dict() returns "
            "references that training updates in place, so it always equals the "
            "model; keep copies: "
            "{name: tensor.clone() for name, tensor in model.state_dict().items()}"
        )
    elif frozen:
        problems.append(
            f"parameters not moving from their initial values: {frozen} (is "
            "optimizer.step() called, on this model's parameters, built before it?)"
        )
    accuracy = test_accuracy(model, test_images, test_labels)
    if accuracy < TARGET_ACCURACY:
        problems.append(
            f"test accuracy {accuracy:.2%} is below the {TARGET_ACCURACY:.0%} target"
        )
        ratio = _gradient_left_ratio(model, test_images, test_labels)
        if ratio > ZERO_GRAD_HINT_RATIO:
            problems.append(
                f"the gradients left in .grad are {ratio:.0f} times those of one "
                "fresh batch: is optimizer.zero_grad() called every step? Without it "
                "each step adds to all earlier gradients"
            )
    fail_if(problems, 1)
    return (
        f"drill 1 passed: {accuracy:.2%} test accuracy after {steps:,} steps "
        f"in {epochs} epochs"
    )


def check_drill_2(
    compiled_model: nn.Module,
    batch_size: int,
    test_images: Tensor,
    compile_s: float,
    eager_step_s: float,
    compiled_step_s: float,
) -> str:
    """A compiled model matching its eager self; three positive timings."""
    problems = []
    # torch.compile(model) wraps the module as _orig_mod; model.compile() compiles it
    # in place, as _compiled_call_impl. Either runs eager under "force_eager".
    compiled = hasattr(compiled_model, "_orig_mod") or (
        getattr(compiled_model, "_compiled_call_impl", None) is not None
    )
    if not compiled:
        problems.append(
            f"{type(compiled_model).__name__} is not compiled: use "
            "torch.compile(model) or model.compile()"
        )
    else:
        # A training-shaped call (train mode, gradients on, one batch): no recompile.
        sample = test_images[:batch_size]
        with torch.compiler.set_stance("force_eager"):
            eager_logits = compiled_model(sample)
        difference = (compiled_model(sample) - eager_logits).abs().max().item()
        if difference > COMPILED_LOGIT_ATOL:
            problems.append(
                f"compiled and eager logits differ by {difference:.2e} "
                f"(> {COMPILED_LOGIT_ATOL})"
            )
    for name, value in [
        ("compile_s", compile_s),
        ("eager_step_s", eager_step_s),
        ("compiled_step_s", compiled_step_s),
    ]:
        if not (isinstance(value, (int, float)) and math.isfinite(value) and value > 0):
            problems.append(
                f"{name} = {value!r}; expected a positive number of seconds"
            )
    fail_if(problems, 2)
    return (
        f"drill 2 passed: compiling took {compile_s:.1f} s; a step "
        f"{eager_step_s * 1e3:.2f} ms eager, {compiled_step_s * 1e3:.2f} ms compiled"
    )


def check_drill_3(
    sgd_optimizer: torch.optim.Optimizer,
    sgd_losses: Sequence[float],
    adamw_losses: Sequence[float],
) -> str:
    """SGD with momentum 0.9, a loss curve as long as AdamW's, and a loss that fell."""
    problems = []
    if not isinstance(sgd_optimizer, torch.optim.SGD):
        problems.append(
            f"the optimizer is {type(sgd_optimizer).__name__}, not torch.optim.SGD"
        )
    elif any(group["momentum"] != 0.9 for group in sgd_optimizer.param_groups):
        problems.append(
            f"momentum is {sgd_optimizer.param_groups[0]['momentum']}, expected 0.9"
        )
    if len(sgd_losses) != len(adamw_losses):
        problems.append(
            f"{len(sgd_losses)} SGD losses against {len(adamw_losses)} AdamW losses: "
            "train the same number of steps so the curves share a step axis"
        )
    window = max(1, len(sgd_losses) // 10)
    first, last = (
        sum(part) / window for part in (sgd_losses[:window], sgd_losses[-window:])
    )
    if not last < first:
        problems.append(
            "SGD's loss did not fall from the first tenth of training to the last"
        )
    fail_if(problems, 3)
    return f"drill 3 passed: SGD loss {first:.3f} -> {last:.3f}"


def check_drill_4(
    accumulated_grads: Mapping[str, Tensor],
    accumulated_state: Mapping[str, Tensor],
    accumulated_model: nn.Module,
    model: nn.Module,
    initial_state: Mapping[str, Tensor],
    train_order: torch.Generator,
    train_images: Tensor,
    train_labels: Tensor,
    test_images: Tensor,
    test_labels: Tensor,
) -> str:
    """Accumulation against the checker's own big-batch steps; both accuracies."""
    reference = copy.deepcopy(model)  # the big-batch run, from drill 1's weights
    reference.load_state_dict(initial_state)
    reference.zero_grad(set_to_none=True)
    grads, state = compared_steps(
        reference.train(),
        train_images,
        train_labels,
        torch.Generator(train_order.device).manual_seed(train_order.initial_seed()),
        ACCUMULATION_BATCH_SIZE,
        ACCUMULATION_BATCH_SIZE,
        COMPARED_STEPS,
    )
    problems = []
    expected = get_total_norm(list(grads.values())).item()
    given = get_total_norm(list(accumulated_grads.values())).item()
    gap = get_total_norm([accumulated_grads[k] - grads[k] for k in grads]).item()
    if gap > GRADIENT_RTOL * expected:
        problems.append(
            f"accumulated_grads differ from the checker's big-batch gradients of "
            f"drill 1's first batch by {gap / expected:.2g} of their norm (float32 "
            f"rounding leaves under {GRADIENT_RTOL:.0e}) and are "
            f"{given / expected:.3g} times as large: divide each micro-batch's loss "
            "by accum_steps (or sum it and divide by the whole batch's size)"
        )
    if same_tensors(accumulated_state, initial_state):
        problems.append(
            f"accumulated_state still holds initial_state's weights: were the "
            f"{COMPARED_STEPS} steps taken, and the weights copied after them?"
        )
    else:
        difference = torch.cat(
            [(accumulated_state[key] - state[key]).abs().flatten() for key in state]
        )
        beyond = (difference > ACCUMULATION_WEIGHT_ATOL).float().mean().item()
        if beyond > MAX_FRACTION_BEYOND_ATOL:
            problems.append(
                f"{beyond:.1%} of the weights differ by more than "
                f"{ACCUMULATION_WEIGHT_ATOL:.0e} from the checker's own "
                f"{COMPARED_STEPS} big-batch steps (float32 rounding leaves under "
                f"{MAX_FRACTION_BEYOND_ATOL:.1%}): {COMPARED_STEPS} steps from "
                "initial_state in drill 1's data order, torch.optim.AdamW("
                f"model.parameters(), lr={COMPARED_LR:g}) without a scheduler, one "
                "step and one zero_grad per batch?"
            )
    big_batch_accuracy = test_accuracy(model, test_images, test_labels)
    accumulated_accuracy = test_accuracy(accumulated_model, test_images, test_labels)
    accuracy_gap = abs(big_batch_accuracy - accumulated_accuracy)
    if same_tensors(accumulated_model.state_dict(), model.state_dict()):
        problems.append(
            "accumulated_model has drill 1's weights: train a new model, with "
            "accumulation"
        )
    elif accuracy_gap > MAX_ACCURACY_GAP:
        problems.append(
            f"test accuracies {big_batch_accuracy:.2%} (drill 1) and "
            f"{accumulated_accuracy:.2%} (accumulated) differ by {accuracy_gap:.2%} "
            f"(> {MAX_ACCURACY_GAP:.1%})"
        )
    fail_if(problems, 4)
    return (
        f"drill 4 passed: accumulation agrees with the checker's big-batch steps; "
        f"test accuracy {big_batch_accuracy:.2%} vs {accumulated_accuracy:.2%} "
        "accumulated"
    )
