"""``slipstream tune``: the cheapest serving configuration and hardware that meets an SLO.

The search strategies (``tune.search``) are pure: given a :class:`~slipstream.tune.space.Space`
and an objective they propose points. The trial runner (``tune.trials``) turns a point
into a real ``slipstream serve`` measured by the bench core; ``tune.session`` joins them.
"""
