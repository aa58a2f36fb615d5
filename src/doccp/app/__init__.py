"""The doccp application: the ``doccp`` command (demo, plan, bench), the demo's corpus and
workload, plan pictures, and the seeded benchmark layouts.

It sits on top of the library and the library never imports it: everything under
``doccp`` outside ``doccp.app`` works (and is tested) without this package.
"""
