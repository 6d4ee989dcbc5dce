-- pgcascade schema, migration 14: recovery of a lost logical capture slot (recover-slot).
--
-- recovery_from: set when recover-slot replaces a lost or missing slot - the queue's position
-- (confirmed_lsn) at the loss, after which changes were never captured - and kept until the
-- repair of every subscriber has finished, so that a recovery that dies half-way is resumed
-- by running it again, and `status` says it is not done.

alter table pgcascade.walcapture add column recovery_from pg_lsn;
