"""A Ray left initialized in this pytest worker by an earlier test, shut down before a test starts its own (tests
only; ``tests`` is on pytest's ``pythonpath``)."""

import warnings


def shut_down_a_leftover_ray() -> None:
    """An earlier test in this worker left Ray initialized: say so and shut it down, so that the caller's
    ``ray.init`` starts the instance it asks for instead of failing with "ray.init twice"."""
    import ray

    if ray.is_initialized():
        warnings.warn(
            "Ray was left initialized by an earlier test in this pytest worker; shutting it down", stacklevel=2
        )
        ray.shutdown()
