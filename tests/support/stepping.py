"""Optimizer-step callables shared by the streaming tests: the in-memory reference and the streamed model."""


def reference_step(optimizer):
    """One step of a plain torch optimizer, then zero its gradients."""

    def step():
        optimizer.step()
        optimizer.zero_grad()

    return step


def offload_step(offload):
    """One step of a streamed model's optimizer (``offload_parameters(...)``), then zero its gradients."""

    def step():
        offload.step()
        offload.zero_grad()

    return step
