-- pgcascade schema, migration 9: parallel apply of a large batch on a leaf.
--
-- subscriber_table.applied_tick: a lane of a parallel apply (replica/parallel.py) committed
-- this table's events up to this tick on its own connection, before the node's last_tick
-- moved there.  While it is above node.last_tick the worker never cuts a batch past it and
-- never applies this table's events up to it again; a change of state clears it.
alter table pgcascade.subscriber_table add column applied_tick int8;
