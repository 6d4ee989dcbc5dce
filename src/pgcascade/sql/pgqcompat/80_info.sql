-- pgq compatibility, part 9: what queues and consumers look like (PgQ's figures).

-- pgq.get_queue_info([queue]) -> per queue: its settings, the age of its last tick
-- (ticker_lag), events per second over the last 20 ticks, events since the last tick (ev_new).
create or replace function pgq.get_queue_info(
    in i_queue_name text,
    out queue_name text, out queue_ntables integer, out queue_cur_table integer,
    out queue_rotation_period interval, out queue_switch_time timestamptz,
    out queue_external_ticker boolean, out queue_ticker_paused boolean,
    out queue_ticker_max_count integer, out queue_ticker_max_lag interval, out queue_ticker_idle_period interval,
    out ticker_lag interval, out ev_per_sec float8, out ev_new bigint, out last_tick_id bigint)
returns setof record
language sql security definer set search_path = pg_catalog as $$
    select q.queue_name, q.queue_ntables, q.queue_cur_table, q.queue_rotation_period, q.queue_switch_time,
           q.queue_external_ticker, q.queue_ticker_paused, q.queue_ticker_max_count, q.queue_ticker_max_lag,
           q.queue_ticker_idle_period, now() - top.tick_time,
           case when ht.tick_time < top.tick_time
                then (top.tick_event_seq - ht.tick_event_seq) / extract(epoch from top.tick_time - ht.tick_time)::float8
           end,
           pgq.seq_getval(q.queue_event_seq::text) - top.tick_event_seq, top.tick_id
      from pgcascade.queue q
      left join lateral (select * from pgcascade.tick t where t.tick_queue = q.queue_id
                          order by t.tick_id desc limit 1) top on true
      left join lateral (select * from pgcascade.tick t where t.tick_queue = q.queue_id
                            and t.tick_id >= top.tick_id - 20 order by t.tick_id limit 1) ht on true
     where i_queue_name is null or q.queue_name = i_queue_name
     order by q.queue_name
$$;

create or replace function pgq.get_queue_info(
    out queue_name text, out queue_ntables integer, out queue_cur_table integer,
    out queue_rotation_period interval, out queue_switch_time timestamptz,
    out queue_external_ticker boolean, out queue_ticker_paused boolean,
    out queue_ticker_max_count integer, out queue_ticker_max_lag interval, out queue_ticker_idle_period interval,
    out ticker_lag interval, out ev_per_sec float8, out ev_new bigint, out last_tick_id bigint)
returns setof record
language sql as $$ select * from pgq.get_queue_info(null) $$;

-- pgq.get_consumer_info([queue [, consumer]]) -> per registration: lag (age of its last
-- finished tick), last_seen, its ticks and open batch, and pending_events (events in ticks it
-- has not finished).
create or replace function pgq.get_consumer_info(
    in i_queue_name text, in i_consumer_name text,
    out queue_name text, out consumer_name text, out lag interval, out last_seen interval,
    out last_tick bigint, out current_batch bigint, out next_tick bigint, out pending_events bigint)
returns setof record
language sql security definer set search_path = pg_catalog as $$
    select q.queue_name, c.co_name, now() - t.tick_time, now() - s.sub_active,
           s.sub_last_tick, s.sub_batch, s.sub_next_tick,
           (select top.tick_event_seq from pgcascade.tick top where top.tick_queue = q.queue_id
             order by top.tick_id desc limit 1) - t.tick_event_seq
      from pgcascade.subscription s
      join pgcascade.queue q on q.queue_id = s.sub_queue
      join pgcascade.consumer c on c.co_id = s.sub_consumer
      left join pgcascade.tick t on t.tick_queue = s.sub_queue and t.tick_id = s.sub_last_tick
     where (i_queue_name is null or q.queue_name = i_queue_name)
       and (i_consumer_name is null or c.co_name = i_consumer_name)
     order by 1, 2
$$;

create or replace function pgq.get_consumer_info(
    in i_queue_name text,
    out queue_name text, out consumer_name text, out lag interval, out last_seen interval,
    out last_tick bigint, out current_batch bigint, out next_tick bigint, out pending_events bigint)
returns setof record
language sql as $$ select * from pgq.get_consumer_info(i_queue_name, null) $$;

create or replace function pgq.get_consumer_info(
    out queue_name text, out consumer_name text, out lag interval, out last_seen interval,
    out last_tick bigint, out current_batch bigint, out next_tick bigint, out pending_events bigint)
returns setof record
language sql as $$ select * from pgq.get_consumer_info(null, null) $$;
