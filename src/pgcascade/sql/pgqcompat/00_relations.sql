-- The pgq compatibility schema, part 1: PgQ 3's relations as views on pgcascade's tables.
--
-- pgcascade's queue is PgQ's model (ticks as snapshots, batches between two ticks, the retry
-- queue, rotating event tables), so PgQ's tables map column for column.  The views are simple
-- enough to be updatable, so tools that `update pgq.queue set queue_ticker_max_lag = ...` or
-- read pgq.subscription keep working; the rows are pgcascade's own, seen by both APIs.
-- Columns PgQ has and pgcascade does not keep (its rotation needs no switch txids, its ticks
-- no sequence) read as null.  The schema is created by install --pgq-compat (core/schema.py),
-- which refuses a database where a real PgQ owns the schema pgq.

create schema if not exists pgq;
comment on schema pgq is 'pgcascade: PgQ 3 compatibility API on the pgcascade queue';

-- PgQ's roles: readers consume, writers insert events, admins manage queues.
do $$
begin
    if not exists (select 1 from pg_roles where rolname = 'pgq_reader') then
        create role pgq_reader;
    end if;
    if not exists (select 1 from pg_roles where rolname = 'pgq_writer') then
        create role pgq_writer;
    end if;
    if not exists (select 1 from pg_roles where rolname = 'pgq_admin') then
        create role pgq_admin in role pgq_reader, pgq_writer;
    end if;
end $$;

create or replace view pgq.queue as
select queue_id, queue_name, queue_ntables, queue_cur_table, queue_rotation_period,
       null::int8 as queue_switch_step1, null::int8 as queue_switch_step2, queue_switch_time,
       queue_external_ticker, queue_disable_insert, queue_ticker_paused,
       queue_ticker_max_count, queue_ticker_max_lag, queue_ticker_idle_period, queue_per_tx_limit,
       'pgcascade.event_' || queue_id as queue_data_pfx,
       queue_event_seq::text as queue_event_seq,
       null::text as queue_tick_seq,
       queue_extra_maint
  from pgcascade.queue;

create or replace view pgq.consumer as
select co_id, co_name from pgcascade.consumer;

create or replace view pgq.subscription as
select sub_id, sub_queue, sub_consumer, sub_last_tick, sub_active, sub_batch, sub_next_tick
  from pgcascade.subscription;

create or replace view pgq.tick as
select tick_queue, tick_id, tick_time, tick_snapshot::text::txid_snapshot as tick_snapshot, tick_event_seq
  from pgcascade.tick;

-- Every event of every queue, in PgQ's column layout (PgQ's event_template is the parent of
-- all event tables, so selecting from it shows them all too).
create or replace view pgq.event_template as
select ev_id, ev_time, ev_txid, (ev_rare).ev_owner as ev_owner, (ev_rare).ev_retry as ev_retry,
       ev_type, ev_data, ev_extra1, (ev_rare).ev_extra2 as ev_extra2,
       (ev_rare).ev_extra3 as ev_extra3, (ev_rare).ev_extra4 as ev_extra4
  from pgcascade.event;

create or replace view pgq.retry_queue as
select ev_retry_after, ev_queue, ev_id, ev_time, null::int8 as ev_txid, ev_owner, ev_retry,
       ev_type, ev_data, ev_extra1, ev_extra2, ev_extra3, ev_extra4
  from pgcascade.retry_queue;

grant usage on schema pgq to public;
grant select on pgq.queue, pgq.consumer, pgq.subscription, pgq.tick to public;
grant select, insert, update, delete on pgq.queue, pgq.consumer, pgq.subscription, pgq.tick, pgq.retry_queue
   to pgq_admin;
grant select on pgq.event_template to pgq_reader;
-- a reader runs the batch's SELECT (pgq.batch_event_sql, get_batch_cursor) as itself
grant usage on schema pgcascade to pgq_reader;
grant select on pgcascade.event to pgq_reader;
