-- pgcascade schema, migration 20: positions between ticks (docs/design.md, "The change path";
-- sql/pgq/53_position.sql).
--
-- A leaf that keeps up reads its provider's events up to a snapshot taken by its fetch, not up
-- to a tick made for it: the fetch writes nothing on the provider.  Its record is then the
-- newest tick that snapshot covers and the snapshot itself (`last_position`, as text; null: the
-- node is at `last_tick` exactly).  A batch from such a position to a tick (`landing`) starts
-- at that snapshot on the provider's side (`sub_start_position`), not at the consumer's tick.
alter table pgcascade.node add column if not exists last_position text;
alter table pgcascade.subscription add column if not exists sub_start_position text;
