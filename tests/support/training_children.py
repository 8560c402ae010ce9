"""Source for fake training children that the scheduler starts in tests, in place of `kaizen-train`.

`RECORDS_ITS_RUN` is what every such child does first, as the trainer does: record its run in the database
named by argv[1], for the policy whose id is argv[2], so that the scheduler finds the run it started.
"""

RECORDS_ITS_RUN = """
import asyncio, sys
from storage.database import Database
from storage.jobs import start_job_run

async def record() -> None:
    database = Database(sys.argv[1])
    async with database.session() as session:
        await start_job_run(session, int(sys.argv[2]), "train", None, {})
        await session.commit()
    await database.dispose()
"""
