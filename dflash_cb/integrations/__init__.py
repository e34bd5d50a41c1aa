"""Layer 3, the live evaluation inside training loops: the loop-neutral ``LiveEvaluator``, its
Lightning and Hugging Face adapters, the distributed collectives, metric sinks, W&B logging and
panels. Imports the layers below."""
