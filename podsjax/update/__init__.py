"""The policy update: what to train (AlgorithmConfig), the batch, the jitted step and its programs."""
