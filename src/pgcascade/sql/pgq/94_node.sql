-- The cascade: branches that repeat their provider's batches, locations and watermarks as
-- events, and the global watermark that keeps every node's history long enough for any
-- subscriber to move to any other provider of the set.

-- pgcascade.branch_tick(queue, tick_id, tick_time, event_seq) -> tick_id.
-- A branch closes a copied batch: the provider's tick with the same id, time and event
-- sequence, in the transaction that inserted the batch's events (they are in it: see
-- tick_snapshot).  The event sequence never goes back, so a branch promoted to root hands out
-- ids after every event it carried.
create or replace function pgcascade.branch_tick(
    i_queue_name text, i_tick_id int8, i_tick_time timestamptz, i_event_seq int8)
returns int8
language plpgsql as $$
declare
    q pgcascade.queue := pgcascade.find_queue(i_queue_name);
begin
    if i_event_seq > coalesce(pg_sequence_last_value(q.queue_event_seq), 0) then
        perform setval(q.queue_event_seq, i_event_seq);
    end if;
    return pgcascade.ticker(i_queue_name, i_tick_id, i_tick_time, i_event_seq);
end $$;

-- pgcascade.set_subscriber_watermark(queue, node, tick): a direct subscriber reports the
-- lowest tick it and its own subscribers still need.
create or replace function pgcascade.set_subscriber_watermark(i_queue_name text, i_node text, i_tick int8)
returns void
language sql as $$
    insert into pgcascade.node_watermark (queue_name, node_name, watermark)
    values (i_queue_name, i_node, i_tick)
    on conflict (queue_name, node_name) do update set watermark = excluded.watermark, reported = now()
$$;

-- pgcascade.local_watermark(queue) -> the lowest tick this node or any node below it needs:
-- its own position (the root: its newest tick) and what its subscribers reported.
create or replace function pgcascade.local_watermark(i_queue_name text) returns int8
language sql stable as $$
    select least(
        coalesce((select n.last_tick from pgcascade.node n
                   where n.queue_name = i_queue_name and n.node_type <> 'root'),
                 (select max(t.tick_id) from pgcascade.tick t join pgcascade.queue q on q.queue_id = t.tick_queue
                   where q.queue_name = i_queue_name)),
        (select min(w.watermark) from pgcascade.node_watermark w where w.queue_name = i_queue_name))
$$;

-- pgcascade.set_global_watermark(queue, tick) -> the tick the registration '.global_watermark'
-- now holds: the newest local tick at or before `tick` (a node made after that tick holds its
-- oldest one).  It never moves back.
create or replace function pgcascade.set_global_watermark(i_queue_name text, i_tick int8) returns int8
language plpgsql as $$
declare
    q pgcascade.queue;
    v_pos int8;
    v_cur int8;
begin
    select * into q from pgcascade.queue where queue_name = i_queue_name;
    if not found or i_tick is null then
        return null;  -- a leaf carries no queue: nothing to keep
    end if;
    select max(tick_id) into v_pos from pgcascade.tick where tick_queue = q.queue_id and tick_id <= i_tick;
    if v_pos is null then
        select min(tick_id) into v_pos from pgcascade.tick where tick_queue = q.queue_id;
    end if;
    select s.sub_last_tick into v_cur from pgcascade.subscription s join pgcascade.consumer c on c.co_id = s.sub_consumer
     where s.sub_queue = q.queue_id and c.co_name = '.global_watermark';
    if v_pos is null or v_pos <= coalesce(v_cur, 0) then
        return v_cur;
    end if;
    perform pgcascade.register_consumer_at(i_queue_name, '.global_watermark', v_pos);
    return v_pos;
end $$;

-- pgcascade.maint_global_watermark(queue) -> the global watermark, on the root: the lowest
-- tick any node of the set still needs.  When it moved, the root keeps it and sends it down
-- as a 'pgcascade.watermark' event and returns it; otherwise (and on other nodes) null.
create or replace function pgcascade.maint_global_watermark(i_queue_name text) returns int8
language plpgsql as $$
declare
    v_wm int8;
    v_old int8;
begin
    perform 1 from pgcascade.node where queue_name = i_queue_name and node_type = 'root';
    if not found then
        return null;
    end if;
    v_wm := pgcascade.local_watermark(i_queue_name);
    select s.sub_last_tick into v_old from pgcascade.subscription s
      join pgcascade.consumer c on c.co_id = s.sub_consumer
      join pgcascade.queue q on q.queue_id = s.sub_queue
     where q.queue_name = i_queue_name and c.co_name = '.global_watermark';
    if v_wm is null or v_wm <= coalesce(v_old, 0) then
        return null;
    end if;
    perform pgcascade.set_global_watermark(i_queue_name, v_wm);
    perform pgcascade.insert_event(i_queue_name, 'pgcascade.watermark', v_wm::text);
    return v_wm;
end $$;

-- pgcascade.apply_cascade_event(queue, type, data, extra1, extra2) -> void: what a subscriber
-- does with the set's own events.
--   pgcascade.location   data = node name, extra1 = its location (null: the node left the set),
--                        extra2 = 'dead' when the node is lost
--   pgcascade.watermark  data = the global watermark tick
--   pgcascade.part-tick  data = a tick of partition queue extra1 whose changes the batch
--                        carries: a merge-leaf of that partition here (a combined-failover
--                        node) is at that tick now
create or replace function pgcascade.apply_cascade_event(
    i_queue_name text, i_type text, i_data text, i_extra1 text, i_extra2 text)
returns void
language plpgsql as $$
begin
    if i_type = 'pgcascade.location' then
        if i_extra1 is null then
            delete from pgcascade.node_location where queue_name = i_queue_name and node_name = i_data;
        else
            insert into pgcascade.node_location (queue_name, node_name, node_location, dead)
            values (i_queue_name, i_data, i_extra1, coalesce(i_extra2 = 'dead', false))
            on conflict (queue_name, node_name)
            do update set node_location = excluded.node_location, dead = excluded.dead;
        end if;
    elsif i_type = 'pgcascade.watermark' then
        perform pgcascade.set_global_watermark(i_queue_name, i_data::int8);
    elsif i_type = 'pgcascade.part-tick' then
        update pgcascade.node set last_tick = greatest(last_tick, i_data::int8)
         where queue_name = i_extra1 and combined_queue = i_queue_name;
    end if;
end $$;

-- pgcascade.create_branch_queue(queue, tick_id, tick_time, event_seq) -> void: the queue of a
-- new branch, starting at its provider's tick (where the branch registered) and taking its
-- ticks from the provider from then on.
create or replace function pgcascade.create_branch_queue(
    i_queue_name text, i_tick_id int8, i_tick_time timestamptz, i_event_seq int8)
returns void
language plpgsql as $$
declare
    v_id int4;
begin
    perform pgcascade.create_queue(i_queue_name);
    select queue_id into v_id from pgcascade.queue where queue_name = i_queue_name;
    delete from pgcascade.tick where tick_queue = v_id;
    perform pgcascade.set_queue_config(i_queue_name, 'external_ticker', 'true');
    perform pgcascade.branch_tick(i_queue_name, i_tick_id, i_tick_time, i_event_seq);
end $$;

-- pgcascade.consumer_tick(queue, consumer) -> the tick a registration is at.
create or replace function pgcascade.consumer_tick(
    i_queue_name text, i_consumer text,
    out tick_id int8, out tick_time timestamptz, out tick_event_seq int8)
language sql stable as $$
    select t.tick_id, t.tick_time, t.tick_event_seq
      from pgcascade.subscription s
      join pgcascade.queue q on q.queue_id = s.sub_queue
      join pgcascade.consumer c on c.co_id = s.sub_consumer
      join pgcascade.tick t on t.tick_queue = s.sub_queue and t.tick_id = s.sub_last_tick
     where q.queue_name = i_queue_name and c.co_name = i_consumer
$$;
