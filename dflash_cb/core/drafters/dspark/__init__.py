"""DSpark: the DFlash backbone with a Markov head (docs/method.md, "Drafter families")."""
