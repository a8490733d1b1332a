"""cotrain: train language models collaboratively over the internet with hivemind."""

__version__ = "0.1.0"
