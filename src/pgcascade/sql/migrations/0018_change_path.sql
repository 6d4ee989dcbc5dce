-- pgcascade schema, migration 18: the change path of issue 25 (docs/design.md, "The change path").
--
-- A consumer that keeps up opens and finishes a batch every few milliseconds now
-- (next_batch_events), so its subscription row is updated hundreds of times a second.  The
-- unique index on sub_batch made each such update a non-HOT one - a new entry in each of the
-- table's three indexes until the next VACUUM - and the row's lookups slowed as the indexes
-- filled with dead entries.  Without it the updates are HOT and pruned on their page; a lookup
-- by batch id reads the table's few rows.  Batch ids come from a sequence: they stay unique.
alter table pgcascade.subscription drop constraint if exists subscription_sub_batch_key;
