"""The generator core: request state, the rules that apply mod actions, the batched step loop."""
