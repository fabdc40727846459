"""The Alembic environment and versions, installed as ``control_plane.migrations`` (setup.py
maps this folder there), so an installed control plane finds them in any folder."""
