-- pgcascade.event_retry_raw(batch_id, ev_id, retry_after, ev_time, ev_retry, ev_type, ev_data,
--     ev_extra1..4) -> 1: park an event of an open batch in the retry queue.  The Python
-- consumer passes the event's fields it already has; no lookup in the event tables.
-- Retrying the same event twice in one batch keeps the first request.
create or replace function pgcascade.event_retry_raw(
    i_batch_id int8, i_ev_id int8, i_retry_after timestamptz,
    i_ev_time timestamptz, i_ev_retry int4, i_ev_type text, i_ev_data text,
    i_extra1 text, i_extra2 text, i_extra3 text, i_extra4 text)
returns int4
language plpgsql as $$
declare
    s pgcascade.subscription;
begin
    s := pgcascade.find_batch(i_batch_id);
    insert into pgcascade.retry_queue (ev_retry_after, ev_queue, ev_owner, ev_id, ev_time, ev_retry,
                                       ev_type, ev_data, ev_extra1, ev_extra2, ev_extra3, ev_extra4)
    values (i_retry_after, s.sub_queue, s.sub_id, i_ev_id, i_ev_time, coalesce(i_ev_retry, 0) + 1,
            i_ev_type, i_ev_data, i_extra1, i_extra2, i_extra3, i_extra4)
    on conflict (ev_owner, ev_id) do nothing;
    return 1;
end $$;

-- pgcascade.event_retry(batch_id, ev_id, retry_after timestamptz | retry_seconds int4) -> 1.
-- PgQ's form: finds the event in the batch (a scan of the batch) and parks it.
create or replace function pgcascade.event_retry(i_batch_id int8, i_ev_id int8, i_retry_after timestamptz)
returns int4
language plpgsql as $$
declare
    e record;
begin
    execute format('select * from (%s) b where ev_id = $1', pgcascade.batch_event_sql(i_batch_id))
       into e using i_ev_id;
    if e.ev_id is null then
        raise exception 'event % is not in batch %', i_ev_id, i_batch_id using errcode = 'P0002';
    end if;
    return pgcascade.event_retry_raw(i_batch_id, e.ev_id, i_retry_after, e.ev_time, e.ev_retry, e.ev_type,
                                     e.ev_data, e.ev_extra1, e.ev_extra2, e.ev_extra3, e.ev_extra4);
end $$;

create or replace function pgcascade.event_retry(i_batch_id int8, i_ev_id int8, i_retry_seconds int4)
returns int4
language sql as $$
    select pgcascade.event_retry(i_batch_id, i_ev_id, now() + make_interval(secs => i_retry_seconds))
$$;

-- pgcascade.maint_retry_events() -> events moved: put due retry events back into their
-- queues, owned by their consumer, in the transaction of this call (so in the next batch).
create or replace function pgcascade.maint_retry_events() returns int4
language plpgsql as $$
declare
    n int4;
begin
    with due as (
        delete from pgcascade.retry_queue r
         where (r.ev_owner, r.ev_id) in (select ev_owner, ev_id from pgcascade.retry_queue
                                          where ev_retry_after <= now() limit 10000)
        returning r.*
    )
    insert into pgcascade.event (ev_id, ev_time, ev_part, ev_type, ev_data, ev_extra1, ev_rare)
    select d.ev_id, d.ev_time, q.queue_id * 16 + q.queue_cur_table, d.ev_type, d.ev_data, d.ev_extra1,
           row(d.ev_extra2, d.ev_extra3, d.ev_extra4, d.ev_retry, d.ev_owner)::pgcascade.event_rare
      from due d join pgcascade.queue q on q.queue_id = d.ev_queue;
    get diagnostics n = row_count;
    return n;
end $$;
