"""What things cost: an evaluation's work and memory, predicted from the drafter's shape (``evaluation``); a served
setting's speed, projected from a cost profile (``serving``); and a real decode's speed, measured (``measured``)."""
