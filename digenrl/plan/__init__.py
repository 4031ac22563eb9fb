"""``digenrl plan``: what a config needs on real devices, before anything is spawned.

``memory``: the per-role memory footprint of a config at the model's real size (meta device) and the
check ``digenrl run`` performs; ``trace``: the activation tracer it uses.
"""
