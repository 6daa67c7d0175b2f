"""The broker's web panel, served at the service's URL inside the hub:
admin pages (overview, queue, leases and jobs, devices, quotas, usage,
audit) and each researcher's own page. See docs/admin.md ("The panel") and
docs/user.md ("Your page").

Plain server-side templates (Jinja2, autoescaped) and one small script
that refreshes the live part of a page; login through the hub's OAuth
(:mod:`.base`); routes in :mod:`.routes`.
"""
