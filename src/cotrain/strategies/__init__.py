"""Training strategies, one module each, behind the ``Strategy`` protocol (``base``): ``sync`` (the seed
recipe: hivemind.Optimizer) and ``diloco`` (local steps, outer rounds; ``diloco_rounds`` runs them). The
registry (cotrain.registry) names them; nothing outside this package asks which strategy a run uses: it asks
the strategy.
"""

__all__ = ["base", "diloco", "diloco_rounds", "overlap", "sync"]
