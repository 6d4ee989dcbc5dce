-- pgq compatibility, part 8: maintenance, as pgqd runs it: it calls ticker(), then each
-- (func_name, func_arg) of maint_operations() in a transaction of its own ('vacuum' is a
-- VACUUM of func_arg), and maint_retry_events() until it returns 0.

-- pgq.maint_rotate_tables_step1(queue) -> 0: switch the queue to its next event table when
-- its rotation period has passed (pgcascade.maint_rotate_tables: once every consumer has
-- passed the table's events).
create or replace function pgq.maint_rotate_tables_step1(i_queue_name text) returns int4
language plpgsql security definer set search_path = pg_catalog as $$
begin
    perform 1 from pgcascade.queue where queue_name = i_queue_name;
    if found then
        perform pgcascade.maint_rotate_tables(i_queue_name);
    end if;
    return 0;
end $$;

-- pgq.maint_rotate_tables_step2() -> 0.  PgQ records here the txid after which the old table
-- may be truncated; pgcascade checks that under the table's lock when it rotates instead.
create or replace function pgq.maint_rotate_tables_step2() returns int4
language sql as $$ select 0 $$;

-- pgq.maint_tables_to_vacuum() -> the often-updated tables to VACUUM: none while autovacuum
-- is on; else pgcascade's (the tables behind the pgq views) and those of pgq_ext, pgq_node and
-- Londiste that exist in the database.
create or replace function pgq.maint_tables_to_vacuum() returns setof text
language sql stable as $$
    select t from pgcascade.maint_tables_to_vacuum() t
     where current_setting('autovacuum') <> 'on'
    union all
    select n.nspname || '.' || c.relname
      from (values ('pgq_ext', 'completed_tick'), ('pgq_ext', 'completed_batch'), ('pgq_ext', 'completed_event'),
                   ('pgq_ext', 'partial_batch'), ('pgq_node', 'local_state'), ('londiste', 'seq_info'),
                   ('londiste', 'completed')) v(scm, tbl)
      join pg_namespace n on n.nspname = v.scm
      join pg_class c on c.relnamespace = n.oid and c.relname = v.tbl
     where current_setting('autovacuum') <> 'on'
$$;

-- pgq.maint_operations() -> (func_name, func_arg): PgQ's list - rotation of the queues whose
-- period has passed, the queues' queue_extra_maint functions, the tables to vacuum - and
-- pgcascade's own upkeep of each queue (global watermark, tick cleanup, which PgQ does inside
-- its rotation; capture triggers of partitions attached since).
create or replace function pgq.maint_operations(out func_name text, out func_arg text)
returns setof record
language sql stable as $$
    with due as (
        select queue_name from pgcascade.queue where queue_switch_time + queue_rotation_period < now()
    )
    select * from (
        select 'pgq.maint_rotate_tables_step1'::text, queue_name from due order by queue_name) a
    union all
    select 'pgq.maint_rotate_tables_step2', null where exists (select 1 from due)
    union all
    select * from (
        select op, queue_name from pgcascade.queue, unnest(queue_extra_maint) with ordinality u(op, k)
         order by queue_name, k) b
    union all
    select 'vacuum', t from pgq.maint_tables_to_vacuum() t
    union all
    select * from (
        select f, queue_name from pgcascade.queue,
               unnest(array['pgcascade.maint_global_watermark', 'pgcascade.maint_tick_cleanup',
                             'pgcascade.maint_capture_partitions', 'pgcascade.maint_key_triggers']) f
         order by queue_name) c
$$;
