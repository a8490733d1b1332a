"""The peers a swarm is made of: trainer, monitor, evaluator (each a class with run() and close()), and the
state keeper the monitor and the evaluator share."""

__all__ = ["evaluator", "keeper", "monitor", "trainer"]
