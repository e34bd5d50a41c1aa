"""EAGLE-3 (SpecForge 0.2.0's ``LlamaForCausalLMEagle3``) as a chain drafter."""
