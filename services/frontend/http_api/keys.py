"""What the HTTP app keeps for its route handlers (aiohttp AppKeys), in a module each route
module imports without importing app.py (which imports them)."""

from __future__ import annotations

from aiohttp import web

from services.frontend.generations import Generations

GENERATIONS = web.AppKey("generations", Generations)
