-- pgcascade schema, migration 7: what Londiste 3's commands need.
--
-- A branch lists in set_seq the sequences it follows: its subscribers may follow only
-- sequences whose values it keeps itself.  Branches installed earlier had set_seq empty until
-- a takeover; fill it from what they follow.
--
-- subscriber_table.copy_node: add-table --copy-node=NODE copies the table's rows from NODE
-- (a root or branch of the set) instead of the provider; '?' (--find-copy-node) means the
-- nearest node upstream that holds the table in sync, found when the copy starts.

insert into pgcascade.set_seq (queue_name, seq_name)
select s.queue_name, s.seq_name
  from pgcascade.subscriber_seq s
  join pgcascade.node n on n.queue_name = s.queue_name and n.node_type = 'branch'
on conflict do nothing;

alter table pgcascade.subscriber_table add column copy_node text;

-- import-londiste: where a node's Londiste 3 stream ends and its pgcascade stream begins.
--   first_tick      pgcascade's tick taken in the transaction that swapped the root's
--                   triggers: every pgcascade event of the set comes after it
--   pgq_final_tick  PgQ's tick taken once every transaction that wrote through Londiste's
--                   triggers had ended: a subscriber's Londiste worker must have applied it
create table pgcascade.londiste_import (
    queue_name      text primary key,
    first_tick      int8 not null,
    pgq_final_tick  int8,
    imported        timestamptz not null default now()
);
