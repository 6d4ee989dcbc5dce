-- pgq compatibility, part 7: the retry queue (pgcascade.retry_queue).

-- pgq.event_retry(batch, ev_id, retry_time) -> 1, or 0 when the event waits for retry already.
create or replace function pgq.event_retry(x_batch_id bigint, x_event_id bigint, x_retry_time timestamptz)
returns int4
language plpgsql security definer set search_path = pg_catalog as $$
declare
    s pgcascade.subscription;
    e record;
begin
    select * into s from pgcascade.subscription where sub_batch = x_batch_id;
    if found then
        select * into e from pgq.get_batch_events(x_batch_id) b where b.ev_id = x_event_id;
    end if;
    if not found then
        raise exception 'event not found';
    end if;
    insert into pgcascade.retry_queue (ev_retry_after, ev_queue, ev_owner, ev_id, ev_time, ev_retry,
                                       ev_type, ev_data, ev_extra1, ev_extra2, ev_extra3, ev_extra4)
    values (x_retry_time, s.sub_queue, s.sub_id, e.ev_id, e.ev_time, coalesce(e.ev_retry, 0) + 1,
            e.ev_type, e.ev_data, e.ev_extra1, e.ev_extra2, e.ev_extra3, e.ev_extra4)
    on conflict (ev_owner, ev_id) do nothing;
    return case when found then 1 else 0 end;
end $$;

create or replace function pgq.event_retry(x_batch_id bigint, x_event_id bigint, x_retry_seconds integer)
returns int4
language sql as $$
    select pgq.event_retry(x_batch_id, x_event_id, now() + make_interval(secs => x_retry_seconds))
$$;

-- pgq.batch_retry(batch, retry_seconds) -> how many events of the batch were put aside for
-- retry (those waiting already are not counted again).
create or replace function pgq.batch_retry(i_batch_id bigint, i_retry_seconds integer) returns int4
language plpgsql security definer set search_path = pg_catalog as $$
declare
    s pgcascade.subscription;
    n int4;
begin
    select * into s from pgcascade.subscription where sub_batch = i_batch_id;
    if not found then
        raise exception 'batch_retry: batch % not found', i_batch_id;
    end if;
    insert into pgcascade.retry_queue (ev_retry_after, ev_queue, ev_owner, ev_id, ev_time, ev_retry,
                                       ev_type, ev_data, ev_extra1, ev_extra2, ev_extra3, ev_extra4)
    select now() + make_interval(secs => i_retry_seconds), s.sub_queue, s.sub_id, b.ev_id, b.ev_time,
           coalesce(b.ev_retry, 0) + 1, b.ev_type, b.ev_data, b.ev_extra1, b.ev_extra2, b.ev_extra3, b.ev_extra4
      from pgq.get_batch_events(i_batch_id) b
    on conflict (ev_owner, ev_id) do nothing;
    get diagnostics n = row_count;
    return n;
end $$;

-- pgq.event_retry_raw(queue, consumer, retry_after, ev_id, ev_time, ev_retry, type, data,
-- extra1..4) -> ev_id: put an event aside for the consumer; a null ev_id takes a new one.
create or replace function pgq.event_retry_raw(
    x_queue text, x_consumer text, x_retry_after timestamptz, x_ev_id bigint, x_ev_time timestamptz,
    x_ev_retry integer, x_ev_type text, x_ev_data text,
    x_ev_extra1 text, x_ev_extra2 text, x_ev_extra3 text, x_ev_extra4 text)
returns int8
language plpgsql security definer set search_path = pg_catalog as $$
declare
    v_sub int4;
    v_queue int4;
    v_seq regclass;
    v_id int8 := x_ev_id;
begin
    select s.sub_id, s.sub_queue, q.queue_event_seq into v_sub, v_queue, v_seq
      from pgcascade.subscription s
      join pgcascade.queue q on q.queue_id = s.sub_queue
      join pgcascade.consumer c on c.co_id = s.sub_consumer
     where q.queue_name = x_queue and c.co_name = x_consumer;
    if not found then
        raise exception 'consumer not registered';
    end if;
    v_id := coalesce(v_id, nextval(v_seq));
    insert into pgcascade.retry_queue (ev_retry_after, ev_queue, ev_owner, ev_id, ev_time, ev_retry,
                                       ev_type, ev_data, ev_extra1, ev_extra2, ev_extra3, ev_extra4)
    values (x_retry_after, v_queue, v_sub, v_id, x_ev_time, x_ev_retry,
            x_ev_type, x_ev_data, x_ev_extra1, x_ev_extra2, x_ev_extra3, x_ev_extra4);
    return v_id;
end $$;

-- pgq.maint_retry_events() -> events put back into their queues, at most 10 a call, the
-- longest due first (pgqd calls it again until it returns 0).  Each goes through
-- insert_event_raw, owned by its consumer, so only that consumer sees it again.
create or replace function pgq.maint_retry_events() returns int4
language plpgsql security definer set search_path = pg_catalog as $$
declare
    r record;
    n int4 := 0;
begin
    lock table pgcascade.retry_queue in share update exclusive mode;  -- one mover at a time
    for r in select q.queue_name, rq.*
               from pgcascade.retry_queue rq join pgcascade.queue q on q.queue_id = rq.ev_queue
              where rq.ev_retry_after <= now() order by rq.ev_retry_after limit 10 loop
        perform pgq.insert_event_raw(r.queue_name, r.ev_id, r.ev_time, r.ev_owner, r.ev_retry, r.ev_type, r.ev_data,
                                     r.ev_extra1, r.ev_extra2, r.ev_extra3, r.ev_extra4);
        delete from pgcascade.retry_queue where ev_owner = r.ev_owner and ev_id = r.ev_id;
        n := n + 1;
    end loop;
    return n;
end $$;
