"""/v1/fleet: the deployment's figures for a scaler, the same as the coordinator's gauges
`spotrl_coordinator_runs_active` and `spotrl_coordinator_preemptible_wanted`: how many runs are
active and the preemptible pool they want. Answered from the read model (`read_model`), with an
ETag; a read costs no Redis round trip."""

from fastapi import APIRouter, HTTPException, Request, Response

from services.coordinator.read_model import ReadModel
from services.coordinator.schemas import FleetPublic
from services.infra.read_limit import NOT_MODIFIED, revalidated
from services.infra.service import Auth, errors


def build_router(model: ReadModel, auth: Auth) -> APIRouter:
    router = APIRouter(prefix="/v1/fleet", tags=["fleet"])
    read = auth.need("read")

    @router.get(
        "",
        response_model=FleetPublic,
        dependencies=read.dependencies,
        responses={**read.responses, **NOT_MODIFIED, **errors(429, 503)},
    )
    async def fleet(request: Request) -> Response:
        """The active runs (running or stalled) and the preemptible pool they want: no run
        (`runs_active` 0) means the pool's minimum; a run with `preemptible_wanted` 0 has no
        figure yet (hold what runs)."""
        if not model.fresh:
            raise HTTPException(503, "redis unavailable", {"Retry-After": "2"})
        doc = model.fleet
        return revalidated(request, doc.body, doc.etag)

    return router
