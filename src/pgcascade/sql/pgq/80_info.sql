-- pgcascade.get_queue_info([queue_name]) -> one row per queue: configuration, current event
-- table, ticker lag (age of the last tick), events waiting for a tick, event rate.
create or replace function pgcascade.get_queue_info(
    i_queue_name text default null,
    out queue_name text, out queue_ntables int4, out queue_cur_table int4,
    out queue_rotation_period interval, out queue_switch_time timestamptz,
    out queue_external_ticker bool, out queue_ticker_paused bool,
    out queue_ticker_max_count int4, out queue_ticker_max_lag interval, out queue_ticker_idle_period interval,
    out ticker_lag interval, out ev_per_sec float8, out ev_new int8, out last_tick_id int8,
    out consumers int4)
returns setof record
language sql stable as $$
    select q.queue_name, q.queue_ntables, q.queue_cur_table, q.queue_rotation_period, q.queue_switch_time,
           q.queue_external_ticker, q.queue_ticker_paused, q.queue_ticker_max_count,
           q.queue_ticker_max_lag, q.queue_ticker_idle_period,
           now() - t.tick_time,
           case when t.tick_time > f.tick_time
                then (t.tick_event_seq - f.tick_event_seq) / extract(epoch from t.tick_time - f.tick_time)::float8 end,
           greatest(coalesce(pg_sequence_last_value(q.queue_event_seq), 0) - t.tick_event_seq, 0),
           t.tick_id,
           (select count(*)::int4 from pgcascade.subscription s where s.sub_queue = q.queue_id)
      from pgcascade.queue q
      left join lateral (select * from pgcascade.tick where tick_queue = q.queue_id
                          order by tick_id desc limit 1) t on true
      left join lateral (select * from pgcascade.tick where tick_queue = q.queue_id
                          order by tick_id limit 1) f on true
     where i_queue_name is null or q.queue_name = i_queue_name
     order by q.queue_name
$$;

-- pgcascade.get_consumer_info([queue_name [, consumer]]) -> one row per registration:
--   lag             age of the last finished tick (how far behind the consumer is)
--   last_seen       time since the consumer last asked for or finished a batch
--   pending_events  events in ticks the consumer has not finished
create or replace function pgcascade.get_consumer_info(
    i_queue_name text default null, i_consumer text default null,
    out queue_name text, out consumer_name text, out lag interval, out last_seen interval,
    out last_tick int8, out current_batch int8, out next_tick int8, out pending_events int8)
returns setof record
language sql stable as $$
    select q.queue_name, c.co_name, now() - lt.tick_time, now() - s.sub_active,
           s.sub_last_tick, s.sub_batch, s.sub_next_tick,
           greatest((select tick_event_seq from pgcascade.tick where tick_queue = q.queue_id
                      order by tick_id desc limit 1) - lt.tick_event_seq, 0)
      from pgcascade.subscription s
      join pgcascade.queue q on q.queue_id = s.sub_queue
      join pgcascade.consumer c on c.co_id = s.sub_consumer
      left join pgcascade.tick lt on lt.tick_queue = s.sub_queue and lt.tick_id = s.sub_last_tick
     where (i_queue_name is null or q.queue_name = i_queue_name)
       and (i_consumer is null or c.co_name = i_consumer)
     order by q.queue_name, c.co_name
$$;

-- pgcascade.tick_horizon(queue, tick) -> what a consumer at that tick has not seen yet: the
-- transactions from the tick snapshot's xmax on, and those in progress at the tick (xip).
-- Readers scan the queue's events in two index range scans on ev_txid, as a batch does.
create or replace function pgcascade.tick_horizon(
    i_queue_name text, i_tick int8, out queue_id int4, out xmax int8, out xip int8[])
language plpgsql stable as $$
declare
    snap pg_snapshot;
begin
    select q.queue_id into tick_horizon.queue_id from pgcascade.queue q where q.queue_name = i_queue_name;
    if not found then
        raise exception 'queue "%" does not exist', i_queue_name using errcode = 'P0002';
    end if;
    select tick_snapshot into snap from pgcascade.tick
     where tick_queue = tick_horizon.queue_id and tick_id = i_tick;
    if not found then
        raise exception 'tick % of queue "%" no longer exists', i_tick, i_queue_name using errcode = 'P0002';
    end if;
    xmax := pg_snapshot_xmax(snap)::text::int8;
    select coalesce(array_agg(x::text::int8), '{}') into xip from pg_snapshot_xip(snap) x;
end $$;

-- pgcascade.pending_event_count(queue, after_tick, snapshot, types) -> the events of these types
-- committed after the tick (not visible in its snapshot) and visible in `snapshot`: what a
-- consumer at that tick has still to apply of what a transaction with that snapshot sees.
-- A copy asks it for EXECUTE events before copying under its snapshot.
create or replace function pgcascade.pending_event_count(
    i_queue_name text, i_after_tick int8, i_snapshot pg_snapshot, i_types text[])
returns int8
language plpgsql stable as $$
declare
    h record;
    n int8;
begin
    select * into h from pgcascade.tick_horizon(i_queue_name, i_after_tick);
    select count(*) into n
      from (select ev_txid, ev_type from pgcascade.event
             where ev_part >= h.queue_id * 16 and ev_part < h.queue_id * 16 + 16 and ev_txid >= h.xmax
            union all
            select ev_txid, ev_type from pgcascade.event
             where ev_part >= h.queue_id * 16 and ev_part < h.queue_id * 16 + 16 and ev_txid = any(h.xip)) e
     where e.ev_type = any(i_types)
       and pg_visible_in_snapshot(e.ev_txid::text::xid8, i_snapshot);
    return n;
end $$;
